"""One prompt's prefill on the fast CPU path, its attention on PyTorch's SDPA or on the compiled kernel.

    .venv/bin/python benchmarks/prefill-attention-2026-12-02/prefill.py THREADS TOKENS {sdpa,kernel}

The embedded SmolLM2 (Q4_1 as stored, `dtype: auto`), one prompt of TOKENS random ids prefilled in one step,
the median of 5 (BENCHMARKS.md, "Long prompts"); `sdpa` turns the prefill kernel off for this process.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engine import Options, _engine
from bench.profile import prefill_time
from builders import BuildOptions, build_engine
from torch_engine.config import DType
from torch_engine.kv_cache import PagedKVCache


def main() -> None:
    threads, tokens, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(threads)
    if which == "sdpa":
        PagedKVCache.prefill_attention = lambda *_args, **_kw: None  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = build_engine("smollm2", Path(tmp) / "e", BuildOptions(dtype=DType.FLOAT32), progress=False)
        opts = Options(engine_dir, "cpu", "auto", [threads], tokens, 32, [1], 1, False, None)
        s = prefill_time(_engine(opts), tokens, 5, random.Random(0))
    print(f"threads {threads} {which:6s}: prefill {tokens} in {1e3 * s:.0f} ms = {tokens / s:.0f} tok/s")


if __name__ == "__main__":
    main()

"""Q6_K kept as stored vs converted to Q8_0 (the engine before), on llama.cpp's own Q5_K_M of SmolLM2.

In SmolLM2's Q5_K_M the 1536-column FFN-down weights are Q5_K or Q6_K (llama.cpp gives Q6_K to a share of the
layers); the 576-column tensors are Q5_1 / Q8_0 (its fallbacks). Until this change the builder requantized Q6_K to
Q8_0 by gguf's quantizer (8.5 bits a weight for the file's 6.5625, with a rounding error). Two engines in one
process: one built from the file (Q6_K kept), one from a copy whose Q6_K tensors were rewritten as the Q8_0 the old
conversion produced (gguf's quantizer over gguf's dequantisation: the same blocks). Each point alternates the two,
5 pairs (``bench.ab.alternate``): medians, and the median of the pairs' ratios.

Needs llama.cpp's binding (``make bench-peers``) to write the Q5_K_M file.
Run from the repository root: ``.venv/bin/python benchmarks/q6_k-2026-12-03/run.py OUT.json [--march x86-64-v3]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize, quantize

import torch_engine.kernels as tk
from bench.ab import compare
from bench.gguf_rewrite import llama_quantize, rewrite
from builders import BuildOptions, build_engine
from builders.embedded import smollm2_gguf
from torch_engine.config import DType, EngineManifest
from torch_engine.cpu import cpu_info

T = GGMLQuantizationType
ROOT = Path("/tmp/k5m")
K5M = ROOT / "smollm2-q5_k_m.gguf"


def q6_k_as_q8_0(src: Path, dst: Path) -> int:
    """``src`` with every Q6_K tensor requantized to Q8_0 as the old builder did (gguf's quantizer)."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if t.tensor_type is not T.Q6_K:
            return None
        n, k = int(t.shape[1]), int(t.shape[0])
        dense = np.asarray(dequantize(t.data, T.Q6_K), dtype=np.float32).reshape(n, k)
        return np.asarray(quantize(dense, T.Q8_0)), T.Q8_0

    return rewrite(src, dst, convert)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--march", default=None, help="build the kernels for this -march (x86-64-v3: the AVX2 paths)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("out", type=Path)
    a = p.parse_args()
    if a.march:
        tk.use_march(a.march)
    if not K5M.exists():
        llama_quantize(smollm2_gguf(), K5M, "Q5_K_M")
    old = ROOT / "smollm2-q5_k_m-q6_kas8.gguf"
    n_q6 = q6_k_as_q8_0(K5M, old)
    dirs = {}
    for name, src in (("q6_k", K5M), ("as_q8_0", old)):
        dirs[name] = build_engine(str(src), ROOT / f"engine6-{name}", BuildOptions(dtype=DType.FLOAT32), progress=False)
    result: dict[str, object] = {
        "cpu": cpu_info().as_dict(), "march": a.march or "native",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "q6_k_tensors": n_q6, "file_bytes": K5M.stat().st_size,
        "engine_bytes": {n: (d / "rank0.safetensors").stat().st_size for n, d in dirs.items()},
        "conversion_error": {n: EngineManifest.load(d).conversion_error for n, d in dirs.items()},
    }  # fmt: skip
    print(result, flush=True)
    result |= compare(("q6_k", dirs["q6_k"]), ("as_q8_0", dirs["as_q8_0"]), a.threads, a.batches)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

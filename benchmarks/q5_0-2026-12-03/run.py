"""Q5_0 kept as stored vs converted to Q8_0 (the engine before), on llama.cpp's own Q4_K_M of SmolLM2.

llama.cpp's Q4_K_M stores every 576-column tensor of SmolLM2 (q, k, v, o, gate, up: 576 is not a multiple
of Q4_K's 256) in Q5_0. Until this change the builder turned Q5_0 into Q8_0 (exactly: ``d * (q - 16)``), so
the engine read 8.5 bits a weight where the file holds 5.5. Two engines in one process: one built from the
file (Q5_0 kept), one from a copy of it whose Q5_0 tensors were rewritten as the Q8_0 blocks the old
conversion produced (the same values, bit for bit). Each point alternates the two (which goes first
alternates too), 5 times; medians, and the median of the pairs' ratios. Prompt 256, 32 decode steps
(``bench.engine.decode_step_ms``); prefill: one 256-token prompt, computed (no prefix cache).

Needs the Q4_K_M file (``make bench-peers``, then the quantize snippet in BENCHMARKS.md, or ``--make``).
Run from the repository root: ``.venv/bin/python benchmarks/q5_0-2026-12-03/run.py OUT.json [--march x86-64-v3]``
(``--march x86-64-v3``: the kernels an AVX2-only CPU builds, run on this CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

import torch_engine.kernels as tk
from bench.ab import compare
from bench.gguf_rewrite import llama_quantize, rewrite
from builders import BuildOptions, build_engine
from builders.embedded import smollm2_gguf
from torch_engine.config import DType
from torch_engine.cpu import cpu_info
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.quant import QuantKind

T = GGMLQuantizationType
ROOT = Path("/tmp/kqm")
KQM = ROOT / "smollm2-q4_k_m.gguf"


def q5_0_as_q8_0(src: Path, dst: Path) -> int:
    """``src`` with every Q5_0 tensor rewritten as Q8_0 blocks of the same values (the old conversion)."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if t.tensor_type is not T.Q5_0:
            return None
        n, k = int(t.shape[1]), int(t.shape[0])
        p = from_gguf_blocks(QuantKind.Q5_0, t.data, (n, k))
        dense = p.dequantize()
        d = p.d.float().repeat_interleave(32, 1)
        q = torch.where(d != 0, dense / d, 0)
        blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
        blocks[:, :, 0:2] = p.d.numpy().view(np.uint8).reshape(n, k // 32, 2)
        blocks[:, :, 2:] = q.round().to(torch.int8).numpy().view(np.uint8).reshape(n, k // 32, 32)
        raw = blocks.reshape(n, k // 32 * 34)
        assert torch.equal(from_gguf_blocks(QuantKind.Q8_0, raw, (n, k)).dequantize(), dense), t.name
        return raw, T.Q8_0

    return rewrite(src, dst, convert)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--make", action="store_true", help="write the Q4_K_M file with llama.cpp's quantizer first")
    p.add_argument("--march", default=None, help="build the kernels for this -march (x86-64-v3: the AVX2 paths)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("out", type=Path)
    a = p.parse_args()
    if a.march:
        tk.use_march(a.march)
    if a.make or not KQM.exists():
        llama_quantize(smollm2_gguf(), KQM, "Q4_K_M")
    old = ROOT / "smollm2-q4_k_m-q5as8.gguf"
    n_q5 = q5_0_as_q8_0(KQM, old)
    dirs = {}
    for name, src in (("q5_0", KQM), ("as_q8_0", old)):
        dirs[name] = build_engine(str(src), ROOT / f"engine-{name}", BuildOptions(dtype=DType.FLOAT32), progress=False)
    sizes = {n: (d / "rank0.safetensors").stat().st_size for n, d in dirs.items()}
    result: dict[str, object] = {
        "cpu": cpu_info().as_dict(), "march": a.march or "native",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "q5_0_tensors": n_q5, "file_bytes": KQM.stat().st_size, "engine_bytes": sizes,
    }  # fmt: skip
    print(result, flush=True)
    result |= compare(("q5_0", dirs["q5_0"]), ("as_q8_0", dirs["as_q8_0"]), a.threads, a.batches)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

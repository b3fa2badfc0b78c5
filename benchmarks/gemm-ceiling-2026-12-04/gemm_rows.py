"""The integer GEMM's rate by weight format and row count (one process, one thread by default): random weights
quantized by the builder, repacked as the engine loads them, ``gemm_q8`` timed (best of 5 rounds) at 1-256 rows.
Shapes: SmolLM2's gate_up (3,072 x 576), its down (576 x 1,536, where the K-quants fit) and its lm_head
(49,152 x 576).

    .venv/bin/python benchmarks/gemm-ceiling-2026-12-04/gemm_rows.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from builders.quantize import quantize_blocks
from torch_engine.cpu import cpu_info
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.kernels import cpu_kernels
from torch_engine.quant import QuantKind, group

SHAPES = {
    "gate_up": ((3072, 576), ["Q4_1", "Q5_0", "Q8_0"]),
    "down": ((576, 1536), ["Q4_1", "Q4_K", "Q6_K", "Q5_0", "Q8_0"]),
    "lm_head": ((49152, 576), ["Q8_0"]),
}
ROWS = [1, 8, 16, 32, 256]


def rate(kernels: object, kind: QuantKind, n: int, k: int, rows: int) -> float:
    """GMAC/s of ``gemm_q8`` on an n x k weight of ``kind`` at ``rows`` rows."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    g = group(from_gguf_blocks(kind, quantize_blocks(w, kind), (n, k)), kernels)
    x, bias = torch.randn(rows, k), torch.empty(0)
    for _ in range(3):
        g.gemm(kernels, x, bias)
    reps = max(3, int(2e9 // (n * k * rows)))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            g.gemm(kernels, x, bias)
        best = min(best, (time.perf_counter() - t) / reps)
    return n * k * rows / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kernels = cpu_kernels()
    assert kernels is not None, "no compiler here: the integer kernels are not built"
    out: dict[str, object] = {"cpu": cpu_info().as_dict(), "path": kernels.i8_path(), "threads": a.threads}
    for shape, ((n, k), kinds) in SHAPES.items():
        for name in kinds:
            rates = {r: rate(kernels, QuantKind[name], n, k, r) for r in ROWS}
            out[f"{shape} {name}"] = rates
            print(f"{shape:8s} {name:5s} " + "  ".join(f"{r:3d} rows {v:6.1f}" for r, v in rates.items()), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()

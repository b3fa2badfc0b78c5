"""The integer GEMM alone: 30 layers of SmolLM2's shapes (qkv 960x576, o 576x576, gate-up 3072x576, down
576x1536), the same random weights quantized as Q5_1, Q5_0, Q4_1 and Q8_0 by gguf, each format's GEMMs timed in
turn (the order reversed every other round), medians over 9 rounds (5 past 16 rows).

Run from the repository root: ``.venv/bin/python benchmarks/q5_1-2026-12-03/gemm.py [--threads 1] [--rows 1 8 64 256]
[--march x86-64-v3]`` (``--march``: the kernels that instruction-set level builds, run on this CPU).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from bench.ab import gemm_args
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.quant import Grouped, QuantKind, group

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
KINDS = [QuantKind.Q5_1, QuantKind.Q5_0, QuantKind.Q4_1, QuantKind.Q8_0]


def main() -> None:
    a, kernels = gemm_args(rows=[1, 8, 64, 256])
    rng = np.random.default_rng(0)
    weights: dict[QuantKind, list[Grouped]] = {q: [] for q in KINDS}
    for _ in range(30):
        for n, k in SHAPES:
            x = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            for q in KINDS:
                raw = quantize(x, GGMLQuantizationType(int(q)))
                weights[q].append(group(from_gguf_blocks(q, raw, (n, k)), kernels))
    print({"march": a.march or "native", "i8_path": kernels.i8_path(), "threads": a.threads,
           "MB": {q.name: round(sum(g.nbytes for g in ws) / 1e6, 1) for q, ws in weights.items()}})  # fmt: skip
    empty = torch.empty(0)
    for rows in a.rows:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        times: dict[QuantKind, list[float]] = {q: [] for q in KINDS}
        for i in range(9 if rows <= 16 else 5):
            for q in KINDS if i % 2 == 0 else KINDS[::-1]:
                t = time.perf_counter()
                for g in weights[q]:
                    g.gemm(kernels, xs[g.k], empty)
                times[q].append((time.perf_counter() - t) * 1e3)
        print(f"rows {rows}: " + "  ".join(f"{q.name} {statistics.median(times[q]):.2f} ms" for q in KINDS), flush=True)


if __name__ == "__main__":
    main()

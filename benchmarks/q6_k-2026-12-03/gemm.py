"""The integer GEMM alone, Q6_K kept vs the Q8_0 the builder made of it before: the same random weights in llama.cpp's
Q6_K layout (``quantize_q6_k``) and as Q8_0 of exactly those values' requantization, each format's GEMMs timed in
turn (the order reversed every other round), medians over 9 rounds (5 past 16 rows). Shapes: SmolLM2's FFN-down
(576x1536) in 30 layers, and a 7B-class FFN-down (4096x11008) in 2.

Run from the repository root: ``.venv/bin/python benchmarks/q6_k-2026-12-03/gemm.py [--threads 1] [--rows 1 8 64 256]
[--march x86-64-v3]`` (``--march``: the kernels that instruction-set level builds, run on this CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import torch_engine.kernels as tk
from builders.quantize import quantize_q6_k, quantize_tensor
from torch_engine.quant import Grouped, QuantKind, from_gguf_blocks, group

SETS = {"smollm2-down": ((576, 1536), 30), "7b-down": ((4096, 11008), 2)}
KINDS = [QuantKind.Q6_K, QuantKind.Q8_0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--march", default=None)
    a = p.parse_args()
    if a.march:
        tk.use_march(a.march)
    kernels = tk.cpu_kernels()
    assert kernels is not None, "the kernels cannot be built here"
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    for name, ((n, k), count) in SETS.items():
        weights: dict[QuantKind, list[Grouped]] = {q: [] for q in KINDS}
        for _ in range(count):
            x = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            six = from_gguf_blocks(QuantKind.Q6_K, quantize_q6_k(x), (n, k))
            weights[QuantKind.Q6_K].append(group(six, kernels))
            weights[QuantKind.Q8_0].append(group(quantize_tensor(six.dequantize(), QuantKind.Q8_0), kernels))
        print({"set": name, "march": a.march or "native", "i8_path": kernels.i8_path(), "threads": a.threads,
               "MB": {q.name: round(sum(g.nbytes for g in ws) / 1e6, 1) for q, ws in weights.items()}})  # fmt: skip
        empty = torch.empty(0)
        for rows in a.rows:
            xs = torch.randn(rows, k)
            times: dict[QuantKind, list[float]] = {q: [] for q in KINDS}
            for i in range(9 if rows <= 16 else 5):
                for q in KINDS if i % 2 == 0 else KINDS[::-1]:
                    t = time.perf_counter()
                    for g in weights[q]:
                        g.gemm(kernels, xs, empty)
                    times[q].append((time.perf_counter() - t) * 1e3)
            med = {q: statistics.median(times[q]) for q in KINDS}
            print(f"  rows {rows}: " + "  ".join(f"{q.name} {med[q]:.2f} ms" for q in KINDS)
                  + f"  Q8_0 / Q6_K {med[QuantKind.Q8_0] / med[QuantKind.Q6_K]:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

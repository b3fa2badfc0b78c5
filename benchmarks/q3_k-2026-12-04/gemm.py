"""The integer GEMM alone on Q3_K kept as stored, vs the Q6_K the builder made of it before (its exact form: the
quants + 28, the same scales), and vs Q4_K of the same weights (the next format up). Random weights encoded as Q3_K
(``builders.quantize``, round to nearest), Q4_K likewise. Each side's GEMMs timed in turn (the order rotated every
round), medians over 9 rounds (5 past 16 rows). Shapes: SmolLM2's FFN-down (576x1536) in 30 layers, a 7B-class
FFN-down (4096x11008) and q_proj (4096x4096) in 2.

Run from the repository root: ``.venv/bin/python benchmarks/q3_k-2026-12-04/gemm.py [--threads 1]
[--rows 1 8 64 256] [--march x86-64-v3]`` (``--march``: the kernels that instruction-set level builds, run here).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.ab import gemm_args
from builders.gguf_convert import _as
from builders.quantize import quantize_tensor
from torch_engine.quant import Grouped, QuantKind, group

SETS = {"smollm2-down": ((576, 1536), 30), "7b-down": ((4096, 11008), 2), "7b-q": ((4096, 4096), 2)}


def main() -> None:
    a, kernels = gemm_args(rows=[1, 8, 64, 256])
    rng = np.random.default_rng(0)
    for name, ((n, k), count) in SETS.items():
        sides: dict[str, list[Grouped]] = {"q3_k": [], "q6_k": [], "q4_k": []}
        for _ in range(count):
            w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
            q3 = quantize_tensor(w, QuantKind.Q3_K)
            forms = (q3, _as(q3, QuantKind.Q6_K), quantize_tensor(w, QuantKind.Q4_K))
            for side, packed in zip(sides, forms, strict=True):
                sides[side].append(group(packed, kernels))
        mb = {s: round(sum(g.nbytes for g in gs) / 1e6, 1) for s, gs in sides.items()}
        print({"set": name, "march": a.march or "native", "i8_path": kernels.i8_path(), "threads": a.threads,
               "MB": mb}, flush=True)  # fmt: skip
        empty = torch.empty(0)
        order = list(sides)
        for rows in a.rows:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {s: [] for s in sides}
            for i in range(9 if rows <= 16 else 5):
                for s in order[i % 3 :] + order[: i % 3]:
                    t = time.perf_counter()
                    for g in sides[s]:
                        g.gemm(kernels, x, empty)
                    times[s].append((time.perf_counter() - t) * 1e3)
            med = {s: statistics.median(v) for s, v in times.items()}
            ratios = f"q6_k / q3_k {med['q6_k'] / med['q3_k']:.2f}  q4_k / q3_k {med['q4_k'] / med['q3_k']:.2f}"
            print(f"  rows {rows}: " + "  ".join(f"{s} {v:.2f} ms" for s, v in med.items()) + "  " + ratios, flush=True)


if __name__ == "__main__":
    main()

"""The integer GEMM alone on IQ4_NL kept as stored, vs the Q8_0 the builder made of it before, and vs Q4_0 (the
same bytes, no table lookup: what the byte shuffle costs). Random weights encoded as IQ4_NL
(``builders.quantize``), the Q8_0 side its exact Q8_0 form (``gguf_convert._as``: the same values), Q4_0 the same
weights quantized by gguf. Each side's GEMMs timed in turn (the order rotated every round), medians over 9 rounds
(5 past 16 rows). Shapes: SmolLM2's gate / up (1536x576) in 30 layers, a 7B-class FFN-down (4096x11008) in 2.

Run from the repository root: ``.venv/bin/python benchmarks/iq4-2026-12-04/gemm.py [--threads 1]
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

SETS = {"smollm2-gate": ((1536, 576), 30), "7b-down": ((4096, 11008), 2)}


def main() -> None:
    a, kernels = gemm_args(rows=[1, 8, 64, 256])
    rng = np.random.default_rng(0)
    for name, ((n, k), count) in SETS.items():
        sides: dict[str, list[Grouped]] = {"iq4_nl": [], "q8_0": [], "q4_0": []}
        for _ in range(count):
            w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
            iq4 = quantize_tensor(w, QuantKind.IQ4_NL)
            forms = (iq4, _as(iq4, QuantKind.Q8_0), quantize_tensor(w, QuantKind.Q4_0))
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
            ratios = f"q8_0 / iq4_nl {med['q8_0'] / med['iq4_nl']:.2f}  q4_0 / iq4_nl {med['q4_0'] / med['iq4_nl']:.2f}"
            print(f"  rows {rows}: " + "  ".join(f"{s} {v:.2f} ms" for s, v in med.items()) + "  " + ratios, flush=True)


if __name__ == "__main__":
    main()

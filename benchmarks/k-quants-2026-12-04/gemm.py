"""The integer GEMM alone, each K-quant kept as stored vs the form the builder gave it before (``before.py``: Q4_K
-> Q4_1, Q5_K / Q6_K -> Q8_0): random weights encoded as each K-quant (``builders.quantize``), each side's GEMMs
timed in turn (the order reversed every other round), medians over 9 rounds (5 past 16 rows). Shapes: SmolLM2's
FFN-down (576x1536) in 30 layers, and a 7B-class FFN-down (4096x11008) in 2.

Run from the repository root: ``.venv/bin/python benchmarks/k-quants-2026-12-04/gemm.py [--threads 1]
[--rows 1 8 64 256] [--march x86-64-v3]`` (``--march``: the kernels that instruction-set level builds, run on this
CPU).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.ab import gemm_args
from builders.quantize import quantize_tensor
from torch_engine.quant import Grouped, group

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before import KEPT, before

SETS = {"smollm2-down": ((576, 1536), 30), "7b-down": ((4096, 11008), 2)}


def main() -> None:
    a, kernels = gemm_args(rows=[1, 8, 64, 256])
    rng = np.random.default_rng(0)
    for name, ((n, k), count) in SETS.items():
        dense = [torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05) for _ in range(count)]
        for kind in KEPT:
            sides: dict[str, list[Grouped]] = {"kept": [], "before": []}
            for w in dense:
                kept = quantize_tensor(w, kind)
                sides["kept"].append(group(kept, kernels))
                sides["before"].append(group(before(kept), kernels))
            old = sides["before"][0].kind.name
            mb = {s: round(sum(g.nbytes for g in gs) / 1e6, 1) for s, gs in sides.items()}
            print({"set": name, "kind": kind.name, "before": old, "march": a.march or "native",
                   "i8_path": kernels.i8_path(), "threads": a.threads, "MB": mb}, flush=True)  # fmt: skip
            empty = torch.empty(0)
            for rows in a.rows:
                x = torch.randn(rows, k)
                times: dict[str, list[float]] = {s: [] for s in sides}
                for i in range(9 if rows <= 16 else 5):
                    for s in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                        t = time.perf_counter()
                        for g in sides[s]:
                            g.gemm(kernels, x, empty)
                        times[s].append((time.perf_counter() - t) * 1e3)
                med = {s: statistics.median(v) for s, v in times.items()}
                print(f"  rows {rows}: {kind.name} {med['kept']:.2f} ms  {old} {med['before']:.2f} ms  "
                      f"{old} / {kind.name} {med['before'] / med['kept']:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

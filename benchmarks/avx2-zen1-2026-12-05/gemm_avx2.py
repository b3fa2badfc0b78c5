"""The integer GEMM's rate on the embedded Q4_1 file's formats (Q4_1, and Q8_0 for the lm_head) at decode and prefill
row counts, one thread, best of 5 rounds (``gemm_rows.py``'s weights and timing). Run it in two trees to compare them:

    PYTHONPATH=/tmp/old .venv/bin/python benchmarks/avx2-zen1-2026-12-05/gemm_avx2.py   # a worktree of the old tree
    .venv/bin/python benchmarks/avx2-zen1-2026-12-05/gemm_avx2.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from torch_engine.kernels import cpu_kernels
from torch_engine.quant import QuantKind

_spec = importlib.util.spec_from_file_location(
    "gemm_rows", Path(__file__).parents[1] / "gemm-ceiling-2026-12-04" / "gemm_rows.py"
)
assert _spec is not None and _spec.loader is not None
gemm_rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemm_rows)

CASES = [("gate_up", "Q4_1"), ("down", "Q4_1"), ("gate_up", "Q4_0"), ("down", "Q5_0"), ("down", "Q4_K"),
         ("lm_head", "Q8_0")]  # fmt: skip
ROWS = [1, 4, 8, 16, 64, 256]


def main() -> None:
    torch.set_num_threads(1)
    kernels = cpu_kernels()
    assert kernels is not None, "no compiler here: the integer kernels are not built"
    for shape, kind in CASES:
        (n, k), _ = gemm_rows.SHAPES[shape]
        rates = [f"{r:3d}: {gemm_rows.rate(kernels, QuantKind[kind], n, k, r):6.1f}" for r in ROWS]
        print(f"{shape:8s} {kind:5s} GMAC/s at rows " + "  ".join(rates), flush=True)


if __name__ == "__main__":
    main()

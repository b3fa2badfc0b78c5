"""The integer GEMM's rate at decode-sized row counts (16-128), the formats of llama.cpp's Q4_K_M of SmolLM2 (one
thread, best of 5 rounds; ``gemm_rows.py``'s weights and timing). Run it in two trees to compare them:

    PYTHONPATH=/tmp/old .venv/bin/python benchmarks/wide-tiles-2026-12-05/gemm_tiles.py   # a worktree of the old tree
    .venv/bin/python benchmarks/wide-tiles-2026-12-05/gemm_tiles.py

``--cases shape:kind ...`` and ``--rows ...`` pick other shapes, formats and row counts.
"""

from __future__ import annotations

import argparse
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

CASES = [("gate_up", "Q5_0"), ("gate_up", "Q8_0"), ("down", "Q6_K"), ("down", "Q5_0"), ("down", "Q4_K"),
         ("lm_head", "Q8_0")]  # fmt: skip
ROWS = [16, 24, 32, 64, 128]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=[f"{shape}:{kind}" for shape, kind in CASES], help="shape:kind")
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    a = p.parse_args()
    torch.set_num_threads(1)
    kernels = cpu_kernels()
    assert kernels is not None, "no compiler here: the integer kernels are not built"
    for case in a.cases:
        shape, kind = case.split(":")
        (n, k), _ = gemm_rows.SHAPES[shape]
        rates = [f"{r:3d}: {gemm_rows.rate(kernels, QuantKind[kind], n, k, r):6.1f}" for r in a.rows]
        print(f"{shape:8s} {kind:5s} GMAC/s at rows " + "  ".join(rates), flush=True)


if __name__ == "__main__":
    main()

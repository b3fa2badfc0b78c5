"""The integer GEMM alone on Q2_K kept as stored, vs the Q8_0 the builder made of it before (gguf's quantizer over
its dequantised weights), and vs Q3_K / Q4_K of the same weights (``bench.ab.time_gemm_sets``: random weights, each
side's GEMMs timed in turn, medians over 9 rounds, 5 past 16 rows). Shapes as ``gemm.py``'s.

Run from the repository root: ``.venv/bin/python benchmarks/q3_k-2026-12-04/gemm_q2_k.py [--threads 1]
[--rows 1 8 64 256] [--march x86-64-v3]``.
"""

from __future__ import annotations

import torch

from bench.ab import time_gemm_sets
from builders.quantize import quantize_tensor
from torch_engine.quant import Packed, QuantKind

SETS = {"smollm2-down": ((576, 1536), 30), "7b-down": ((4096, 11008), 2), "7b-q": ((4096, 4096), 2)}


def forms(w: torch.Tensor) -> tuple[Packed, Packed, Packed, Packed]:
    q2 = quantize_tensor(w, QuantKind.Q2_K)
    before = quantize_tensor(q2.dequantize(), QuantKind.Q8_0)
    return q2, before, quantize_tensor(w, QuantKind.Q3_K), quantize_tensor(w, QuantKind.Q4_K)


if __name__ == "__main__":
    time_gemm_sets(SETS, ("q2_k", "q8_0", "q3_k", "q4_k"), forms)

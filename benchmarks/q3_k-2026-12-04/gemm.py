"""The integer GEMM alone on Q3_K kept as stored, vs the Q6_K the builder made of it before (its exact form: the
quants + 28, the same scales), and vs Q4_K of the same weights (the next format up). Random weights encoded as Q3_K
(``builders.quantize``, round to nearest), Q4_K likewise. Each side's GEMMs timed in turn (the order rotated every
round), medians over 9 rounds (5 past 16 rows). Shapes: SmolLM2's FFN-down (576x1536) in 30 layers, a 7B-class
FFN-down (4096x11008) and q_proj (4096x4096) in 2.

Run from the repository root: ``.venv/bin/python benchmarks/q3_k-2026-12-04/gemm.py [--threads 1]
[--rows 1 8 64 256] [--march x86-64-v3]`` (``--march``: the kernels that instruction-set level builds, run here).
"""

from __future__ import annotations

import torch

from bench.ab import time_gemm_sets
from builders.gguf_convert import _as
from builders.quantize import quantize_tensor
from torch_engine.quant import Packed, QuantKind

SETS = {"smollm2-down": ((576, 1536), 30), "7b-down": ((4096, 11008), 2), "7b-q": ((4096, 4096), 2)}


def forms(w: torch.Tensor) -> tuple[Packed, Packed, Packed]:
    q3 = quantize_tensor(w, QuantKind.Q3_K)
    return q3, _as(q3, QuantKind.Q6_K), quantize_tensor(w, QuantKind.Q4_K)


if __name__ == "__main__":
    time_gemm_sets(SETS, ("q3_k", "q6_k", "q4_k"), forms)

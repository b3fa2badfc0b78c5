"""The integer GEMM alone on IQ4_NL kept as stored, vs the Q8_0 the builder made of it before, and vs Q4_0 (the
same bytes, no table lookup: what the byte shuffle costs). Random weights encoded as IQ4_NL
(``builders.quantize``), the Q8_0 side its exact Q8_0 form (``gguf_convert._as``: the same values), Q4_0 the same
weights quantized by gguf. Each side's GEMMs timed in turn (the order rotated every round), medians over 9 rounds
(5 past 16 rows). Shapes: SmolLM2's gate / up (1536x576) in 30 layers, a 7B-class FFN-down (4096x11008) in 2.

Run from the repository root: ``.venv/bin/python benchmarks/iq4-2026-12-04/gemm.py [--threads 1]
[--rows 1 8 64 256] [--march x86-64-v3]`` (``--march``: the kernels that instruction-set level builds, run here).
"""

from __future__ import annotations

import torch

from bench.ab import time_gemm_sets
from builders.gguf_convert import _as
from builders.quantize import quantize_tensor
from torch_engine.quant import Packed, QuantKind

SETS = {"smollm2-gate": ((1536, 576), 30), "7b-down": ((4096, 11008), 2)}


def forms(w: torch.Tensor) -> tuple[Packed, Packed, Packed]:
    iq4 = quantize_tensor(w, QuantKind.IQ4_NL)
    return iq4, _as(iq4, QuantKind.Q8_0), quantize_tensor(w, QuantKind.Q4_0)


if __name__ == "__main__":
    time_gemm_sets(SETS, ("iq4_nl", "q8_0", "q4_0"), forms)

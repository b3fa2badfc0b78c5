"""What the builder made of a K-quant tensor before the engine kept Q4_K / Q5_K / Q6_K as stored (2026-12-03):
Q4_K -> Q4_1 (the quants kept, each block's scale ``d * sc`` and minimum ``-dmin * mn`` rounded to fp16), Q5_K and
Q6_K -> Q8_0 by gguf's quantizer over gguf's dequantisation. Shared by ``gemm.py`` and ``run.py``."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from builders.quantize import quantize_tensor
from torch_engine.quant import BLOCK, Packed, QuantKind

KEPT = (QuantKind.Q4_K, QuantKind.Q5_K, QuantKind.Q6_K)


def before(p: Packed) -> Packed:
    """A kept K-quant weight -> the form the old builder gave it."""
    if p.kind is not QuantKind.Q4_K:
        return quantize_tensor(p.dequantize(), QuantKind.Q8_0)
    assert p.m is not None
    n, k = p.shape
    ds, sm = p.d.float().reshape(n, k // 256, 1, 2), p.m.float().reshape(n, k // 256, 8, 2)
    scale, minimum = (ds[..., 0] * sm[..., 0]).half(), (-(ds[..., 1] * sm[..., 1])).half()
    return Packed(QuantKind.Q4_1, p.qs, scale.reshape(n, k // BLOCK), minimum.reshape(n, k // BLOCK))


def gguf_blocks(p: Packed) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A Q4_1 / Q8_0 packed weight -> its GGUF blocks (d, [m,] quants per 32) and type."""
    n, k = p.shape
    nb = k // BLOCK
    d = p.d.numpy().view(np.uint8).reshape(n, nb, 2)
    if p.kind is QuantKind.Q8_0:
        parts = [d, p.qs.numpy().view(np.uint8).reshape(n, nb, 32)]
    else:
        assert p.m is not None
        parts = [d, p.m.numpy().view(np.uint8).reshape(n, nb, 2), p.qs.numpy().reshape(n, nb, 16)]
    return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(n, -1)), GGMLQuantizationType(int(p.kind))


def same(a: Packed, b: Packed) -> bool:
    return bool(torch.equal(a.dequantize(), b.dequantize()))

"""Quantize a checkpoint's dense GEMM weights at build time (``disagg build --weights q8_0 | q6_k | q5_k | q5_1 |
q5_0 | q4_k | q4_1 | q4_0 | iq4_nl | q3_k | q2_k``).

A Hugging Face checkpoint, or the dense tensors of a GGUF file (F16, BF16, F32; its quantized ones
are kept or converted on import, ``builders/gguf_convert.py``), become the block formats the engine's integer
kernels read (``torch_engine/quant.py``), quantized by gguf's reference quantizer — the file a
``llama-quantize`` run would write for those tensors — or, for the K-quants and IQ4_NL, which gguf's Python package
cannot quantize, by ``quantize_q6_k`` / ``quantize_k4`` / ``quantize_q3_k`` / ``quantize_q2_k`` / ``quantize_iq4_nl``
here (plain round-to-nearest, not llama.cpp's error search):

- the decoder layers' attention projections (q, k, v, o) and dense MLP (gate, up, down): the chosen
  format (Q8_0: int8 per block of 32 with an fp16 scale; Q6_K: 6 bits with an int8 scale per 16 and an fp16
  one per 256; Q5_K / Q4_K: 5 / 4 bits with a 6-bit scale and minimum per 32 and fp16 ones per 256; the K-quants
  Q8_0 where a row is not a multiple of 256 weights, as llama.cpp falls back; Q5_0: 5 bits with a
  scale; Q5_1: 5 bits with a scale and a minimum; Q4_0: int4 with a scale; Q4_1: int4 with a scale and a
  minimum; IQ4_NL: 4-bit indices into a non-uniform table of 16 int8 values, with a scale; Q3_K: 3 bits with a
  signed 6-bit scale per 16 and an fp16 one per 256; Q2_K: 2 bits with a 4-bit scale and minimum per 16 and fp16 ones
  per 256);
- the token embedding and an untied lm_head: Q8_0 whatever the choice (as llama.cpp's Q4 presets
  keep the output in 6-8 bits: the logits are the most sensitive GEMM);
- everything else (norms, biases, MLA and MoE weights, rows whose width is not a multiple of 32)
  stays dense.

The error is measured and returned (``QuantReport``): the relative RMS error of each format over
the weights it replaced; ``build_engine`` logs it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from builders.checkpoint import Checkpoint
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.quant import BLOCK, IQ4_NL_VALUES, Packed, QuantKind

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(slots=True)
class QuantReport:
    """Per format: tensors quantized, weights, and the squared error and squared norm summed over them."""

    tensors: dict[str, int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    err2: dict[str, float] = field(default_factory=dict)
    norm2: dict[str, float] = field(default_factory=dict)

    def add(self, key: QuantKind | str, dense: torch.Tensor, packed: Packed) -> None:
        """One tensor ``dense`` replaced by ``packed``, under ``key`` (a format, or a conversion's name)."""
        k = key.name if isinstance(key, QuantKind) else key
        diff = packed.dequantize().double() - dense.double()
        self.tensors[k] = self.tensors.get(k, 0) + 1
        self.weights[k] = self.weights.get(k, 0) + dense.numel()
        self.err2[k] = self.err2.get(k, 0.0) + float((diff * diff).sum())
        self.norm2[k] = self.norm2.get(k, 0.0) + float((dense.double() ** 2).sum())

    def relative_rms(self, key: QuantKind | str) -> float:
        """sqrt(sum of squared errors / sum of squared weights) over the tensors of ``key``."""
        k = key.name if isinstance(key, QuantKind) else key
        n = self.norm2.get(k, 0.0)
        return float(np.sqrt(self.err2.get(k, 0.0) / n)) if n else 0.0

    def errors(self) -> dict[str, float]:
        """Each key's relative RMS error (the engine manifest's ``converted``)."""
        return {k: self.relative_rms(k) for k in sorted(self.tensors)}

    def summary(self) -> str:
        return "; ".join(
            f"{k}: {self.tensors[k]} tensors, {self.weights[k]:,} weights, relative RMS error "
            f"{100 * self.relative_rms(k):.3g}%"
            for k in sorted(self.tensors)
        )


def quantize_tensor(w: torch.Tensor, kind: QuantKind) -> Packed:
    """A dense ``[N, K]`` weight (K a multiple of ``kind.block_weights``) in ``kind``."""
    n, k = w.shape
    return from_gguf_blocks(kind, quantize_blocks(w.detach().float().numpy(), kind), (n, k))


def quantize_blocks(w: np.ndarray, kind: QuantKind) -> np.ndarray:
    """A dense ``[N, K]`` fp32 array -> its GGUF blocks in ``kind`` (``[N, K / block_weights * block_bytes]``
    uint8): gguf's reference quantizer; ``quantize_q6_k``, ``quantize_k4``, ``quantize_q3_k``, ``quantize_iq4_nl`` for
    the formats it cannot write."""
    if kind is QuantKind.Q6_K:
        return quantize_q6_k(w)
    if kind is QuantKind.Q3_K:
        return quantize_q3_k(w)
    if kind is QuantKind.Q2_K:
        return quantize_q2_k(w)
    if kind is QuantKind.IQ4_NL:
        return quantize_iq4_nl(w)
    if kind.two_level:
        return quantize_k4(w, kind)
    return np.asarray(quantize(w, GGMLQuantizationType(int(kind))))


def quantize_k4(w: np.ndarray, kind: QuantKind) -> np.ndarray:
    """``[N, K]`` fp32 (K a multiple of 256) -> Q4_K / Q5_K super-blocks, GGUF's byte layout (see
    ``torch_engine.gguf_blocks._from_k4``). Each 32 weights' range [min(x, 0), max(x)] spans the quants (0..15 / 0..31);
    the super-block's fp16 ``d`` / ``dmin`` map the largest scale / minimum to 63, each rounds to 6 bits of it, and
    the quants round to nearest under the final scale and minimum."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"{kind.name} needs a multiple of 256 columns, got {k}")
    top = 31 if kind is QuantKind.Q5_K else 15
    sub = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _affine_round(sub, top, 63)  # q: [S, 8, 32]
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    low = q & 0x0F
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c + 1
    parts = [d.view(np.uint8), dmin.view(np.uint8), scales]
    if kind is QuantKind.Q5_K:  # byte i, bit s: sub-block s's element i's 5th bit
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8))
    blocks = np.concatenate([*parts, qs], axis=1)
    return blocks.reshape(n, k // 256 * kind.block_bytes)


def _affine_round(
    sub: np.ndarray, top: int, levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks of sub-blocks ``[S, m, w]`` -> each sub-block's range [min(x, 0), max(x)] spanning the quants
    0..``top``: the super-block's fp16 ``d`` / ``dmin`` ``[S, 1]`` map the largest scale / minimum to ``levels``, each
    sub-block's scale ``sc`` and minimum ``mn`` ``[S, m]`` (uint8) round to that many steps of them, and the quants
    ``q`` ``[S, m, w]`` (uint8) round to nearest under the final ``d * sc`` and ``dmin * mn`` (Q4_K / Q5_K / Q2_K)."""
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale, offset = (sub.max(axis=2) - lo) / top, -lo
    d = (scale.max(axis=1, keepdims=True) / levels).astype(np.float16)
    dmin = (offset.max(axis=1, keepdims=True) / levels).astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d.astype(np.float32))), 0, levels).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dmin == 0, 1, dmin.astype(np.float32))), 0, levels).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[:, :, None]
    shift = (dmin.astype(np.float32) * mn)[:, :, None]
    q = np.clip(np.round((sub + shift) / np.where(step == 0, 1, step)), 0, top).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 (K a multiple of 32) -> IQ4_NL blocks (fp16 ``d``, then 16 bytes of 4-bit indices into
    ``IQ4_NL_VALUES``: byte j element j's in its low nibble, element j + 16's in its high one). Each block's ``d``
    maps its extreme to -127; each weight takes the nearest table value (not llama.cpp's search over scales)."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    d = (np.take_along_axis(x, np.abs(x).argmax(axis=2)[..., None], axis=2) / -127.0).astype(np.float16)
    values = IQ4_NL_VALUES.numpy().astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d != 0, x / d.astype(np.float32), 0)
    idx = np.abs(scaled[..., None] - values).argmin(axis=3).astype(np.uint8)
    qs = idx[:, :, :16] | (idx[:, :, 16:] << 4)
    return np.ascontiguousarray(np.concatenate([d.view(np.uint8), qs], axis=2)).reshape(n, k // BLOCK * 18)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 (K a multiple of 256) -> Q6_K super-blocks, GGUF's byte layout (see
    ``torch_engine.gguf_blocks._from_q6_k``). Each 16 weights' scale maps their largest magnitude to -32 (signed, as
    ggml does); the super-block's fp16 ``d`` maps the largest scale to -128 and each scale rounds to an int8 of it;
    the quants round to nearest under the final ``d * sc``."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q6_K needs a multiple of 256 columns, got {k}")
    sb = k // 256
    x = w.astype(np.float32).reshape(n, sb, 16, 16)
    at = np.abs(x).argmax(axis=3)[..., None]
    extreme = np.take_along_axis(x, at, axis=3)[..., 0]  # [n, sb, 16], signed
    scale = extreme / -32.0
    big = np.take_along_axis(scale, np.abs(scale).argmax(axis=2)[..., None], axis=2)  # [n, sb, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        d = (big / -128.0).astype(np.float16)
        sc = np.where(d != 0, np.rint(scale / d.astype(np.float32)), 0).clip(-128, 127).astype(np.int8)
        step = d.astype(np.float32) * sc.astype(np.float32)  # [n, sb, 16]
        signed = np.where(step[..., None] != 0, np.rint(x / step[..., None]), 0).clip(-32, 31).astype(np.int16)
    return q6_k_blocks(d.reshape(n, sb), sc.reshape(n, sb * 16), (signed + 32).astype(np.uint8).reshape(n, k))


def q6_k_blocks(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K's parts (``d`` ``[N, K / 256]`` float16, the scales ``sc`` ``[N, K / 16]`` int8, the quants ``q`` ``[N, K]``
    uint8 in 0..63, element order) -> its super-blocks, GGUF's byte layout ``[N, K / 256 * 210]``."""
    n, sb = d.shape
    q = q.reshape(n, sb, 2, 128)  # element 128 h + e
    ql = (q[:, :, :, :64] & 0x0F) | ((q[:, :, :, 64:] & 0x0F) << 4)  # byte 64 h + i: elements i, 64 + i
    top = (q >> 4).reshape(n, sb, 2, 4, 32)  # element 128 h + 32 s + i -> byte 32 h + i, bits 2 s
    qh = (top << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)).sum(axis=3, dtype=np.uint8)
    parts = [ql.reshape(n, sb, 128), qh.reshape(n, sb, 64), sc.reshape(n, sb, 16).view(np.uint8),
             d.reshape(n, sb, 1).view(np.uint8)]  # fmt: skip
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(n, sb * 210)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 (K a multiple of 256) -> Q3_K super-blocks, GGUF's byte layout (see
    ``torch_engine.gguf_blocks._from_q3_k``). Each 16 weights' signed scale maps their extreme to -4; the super-block's
    fp16 ``d`` maps the largest scale to -32 and each scale rounds to 6 bits of it (-32..31); the quants round to
    nearest under the final ``d * sc`` (-4..3)."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q3_K needs a multiple of 256 columns, got {k}")
    sb = k // 256
    x = w.astype(np.float32).reshape(n, sb, 16, 16)
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=3)[..., None], axis=3)[..., 0] / -4.0  # [n, sb, 16]
    big = np.take_along_axis(extreme, np.abs(extreme).argmax(axis=2)[..., None], axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = (big / -32.0).astype(np.float16)
        sc = np.where(d != 0, np.rint(extreme / d.astype(np.float32)), 0).clip(-32, 31)
        step = (d.astype(np.float32) * sc)[..., None]
        q = np.where(step != 0, np.rint(x / step), 0).clip(-4, 3).astype(np.int8).reshape(n, sb, 8, 32)
    hmask = ((q >= 0).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).sum(2, dtype=np.uint8)
    two = (q.view(np.uint8) & 3).reshape(n, sb, 2, 4, 32) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    six = (sc + 32).astype(np.uint8)  # [n, sb, 16]
    scales = np.concatenate([(six[:, :, :8] & 15) | ((six[:, :, 8:] & 15) << 4),
                             ((six >> 4).reshape(n, sb, 4, 4) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1))
                             .sum(2, dtype=np.uint8)], axis=2)  # fmt: skip
    out = [hmask, two.sum(3, dtype=np.uint8).reshape(n, sb, 64), scales, d.view(np.uint8)]
    return np.ascontiguousarray(np.concatenate(out, axis=2)).reshape(n, sb * 110)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 (K a multiple of 256) -> Q2_K super-blocks, GGUF's byte layout (see
    ``torch_engine.gguf_blocks._from_q2_k``). Each 16 weights' range [min(x, 0), max(x)] spans the quants (0..3); the
    super-block's fp16 ``d`` / ``dmin`` map the largest scale / minimum to 15, each rounds to 4 bits of it, and the
    quants round to nearest under the final scale and minimum."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q2_K needs a multiple of 256 columns, got {k}")
    sb = k // 256
    d, dmin, sc, mn, q = _affine_round(w.astype(np.float32).reshape(n * sb, 16, 16), 3, 15)  # q: [S, 16, 16]
    two = q.reshape(n * sb, 2, 4, 32) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)  # 128 h + 32 s + i
    parts = [sc | (mn << 4), two.sum(axis=2, dtype=np.uint8).reshape(n * sb, 64), d.view(np.uint8),
             dmin.view(np.uint8)]  # fmt: skip
    return np.ascontiguousarray(np.concatenate(parts, axis=1)).reshape(n, sb * 84)


def _target(name: str, ck: Checkpoint, kind: QuantKind) -> QuantKind | None:
    """The format ``name`` is quantized to, or None (it stays as it is)."""
    if name in _TABLES:
        return QuantKind.Q8_0
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, part = int(m.group(1)), m.group(2)
    if part.startswith("self_attn") and ck.config.is_mla:
        return None
    if part.startswith("mlp") and ck.config.is_moe_layer(layer):
        return None
    return kind


def quantize_checkpoint(ck: Checkpoint, kind: QuantKind) -> tuple[Checkpoint, QuantReport]:
    """``ck`` with its dense GEMM weights in ``kind`` (tables in Q8_0); tensors already packed stay."""
    report = QuantReport()
    tensors = dict(ck.tensors)
    for name, w in ck.tensors.items():
        target = _target(name, ck, kind)
        if target is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] % BLOCK:
            continue
        if w.shape[1] % target.block_weights:  # the K-quants' rows of 256: Q8_0 otherwise, as llama.cpp falls back
            target = QuantKind.Q8_0
        packed = quantize_tensor(w, target)
        report.add(target, w, packed)
        tensors[name] = packed
    log.info("quantized %s at build time: %s", ck.name, report.summary())
    errors = {**ck.converted, **{f"dense->{k}": e for k, e in report.errors().items()}}
    return Checkpoint(ck.config, tensors, ck.save_tokenizer, ck.name, errors), report

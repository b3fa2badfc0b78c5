"""GGUF block formats the engine does not compute with, converted at build time into ones it does.

Most published GGUF files use llama.cpp's K-quants: a ``Q4_K_M`` file is Q4_K with Q6_K for the most
sensitive tensors, and Q5_0 / Q8_0 where a row is not a multiple of 256 weights (a ``Q5_K_M`` file Q5_K / Q6_K,
and Q5_1 / Q8_0 there). The engine computes with Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, Q4_0, Q4_1 and
IQ4_NL as stored (``torch_engine/quant.py``). With ``--weights as-stored`` (the default) each 2-D tensor in another
format becomes one of those, so the integer kernels read it packed instead of a dense bf16 copy:

- **IQ4_XS -> IQ4_NL** (kept as stored): the same 4-bit indices into the same table, each 32 weights' scale ``d *
  (scale - 32)`` rounded to fp16 (each weight within 2^-11 of itself; 4.5 bits a weight for the file's 4.25).
- **Every other quantized format** gguf can dequantise (the other IQ formats) -> Q8_0 by gguf's reference quantizer over
  the exact dequantised weights: each weight within half its block's new step (max |w| / 254), finer than every source
  format's own step.
- F32 / F16 / BF16 tensors stay dense (``--weights q8_0 | q6_k | ... | q4_0`` quantizes them, ``builders.quantize``).

The error of each conversion is measured against gguf's dequantisation of the source (the relative
RMS over the tensors converted) and reported (``QuantReport``; the build logs it and writes it into
the engine's manifest).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from builders.checkpoint import Checkpoint
from builders.quantize import QuantReport, quantize_tensor
from torch_engine.gguf_blocks import q6_k
from torch_engine.quant import IQ4_NL_VALUES, Packed, QuantKind

log = logging.getLogger(__name__)

_K = GGMLQuantizationType
_DENSE = {_K.F32, _K.F16, _K.BF16, _K.F64, _K.I8, _K.I16, _K.I32, _K.I64}


def converts(qtype: GGMLQuantizationType) -> bool:
    """Whether a tensor stored as ``qtype`` is converted (rather than kept as stored, or left dense)."""
    return int(qtype) not in {int(k) for k in QuantKind} and qtype not in _DENSE


def target(qtype: GGMLQuantizationType) -> QuantKind:
    """The engine format a converted ``qtype`` tensor becomes."""
    return QuantKind.IQ4_NL if qtype is _K.IQ4_XS else QuantKind.Q8_0


def convert(qtype: GGMLQuantizationType, raw: np.ndarray, shape: tuple[int, int], report: QuantReport) -> Packed:
    """A GGUF tensor's raw blocks (``GGUFReader``'s ``data``) of ``shape`` ``[N, K]`` (K a multiple of 32)
    -> the engine's packed form, its error against gguf's dequantisation added to ``report``."""
    n, k = shape
    exact = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k).copy())
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)
    if qtype is _K.IQ4_XS:
        packed = _from_iq4_xs(blocks.reshape(n, k // 256, 136), n, k)
    else:
        packed = quantize_tensor(exact, target(qtype))
    report.add(f"{qtype.name}->{packed.kind.name}", exact, packed)
    return packed


def _from_iq4_xs(blocks: np.ndarray, n: int, k: int) -> Packed:
    """IQ4_XS super-blocks ``[N, K / 256, 136]`` (d, 8 6-bit scales offset by 32: their low 4 bits in 4 bytes, their
    top 2 in a 16-bit word; then the 4-bit indices, IQ4_NL's) -> IQ4_NL: the same indices, each block's scale ``d *
    (scale - 32)`` rounded to fp16 (each weight within 2^-11 of itself; the report states the error). A ValueError
    where such a scale leaves fp16's range (no fp16-scaled block format holds those weights; never seen in a real
    file)."""
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)  # [n, sb, 1]
    hi = (blocks[:, :, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [n, sb, 8]
    lo = (blocks[:, :, 4:8].reshape(n, -1, 4, 1) >> np.array([0, 4], dtype=np.uint8)) & 0x0F  # [n, sb, 4, 2]
    scale = (lo.reshape(n, -1, 8) | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    with np.errstate(over="ignore"):
        dl = (d * scale.astype(np.float32)).astype(np.float16).reshape(n, k // 32)
    if not np.isfinite(dl).all():
        raise ValueError(
            "an IQ4_XS block's scale d * (scale - 32) exceeds fp16's range (65504): build with --weights fp32"
        )
    qs = np.ascontiguousarray(blocks[:, :, 8:136]).reshape(n, k // 2)
    return Packed(QuantKind.IQ4_NL, torch.from_numpy(qs), torch.from_numpy(np.ascontiguousarray(dl)))


# ---- weights the engine fuses (q, k, v -> qkv; gate, up -> gate_up) must share one format ----------------
# llama.cpp's mixes store them differently (Q4_K_M: attn_v in Q6_K in some layers, q / k in Q4_K; SmolLM2's:
# attn_v in Q8_0 in some layers, q / k in Q5_0). Q4_K converts exactly into Q5_K (the 5th bits 0); otherwise nothing
# converts exactly into or out of the K-quants' two-level scales, so a group mixing one with another format becomes
# Q8_0, the finest. Q3_K converts exactly into Q6_K only (the quants + 28, the same scales), IQ4_NL's table values
# into Q8_0 only: a mix with them becomes Q6_K or Q8_0 too.

_FUSED = (re.compile(r"(.*\.self_attn\.)([qkv])_proj\.weight"), re.compile(r"(.*\.mlp\.)(gate|up)_proj\.weight"))
# The formats each one converts into exactly (the same values; _as), and the order the formats are tried in: the
# smallest one every member of a group converts into exactly, else the finest among them (the others requantized).
_EXACT = {
    QuantKind.Q4_0: {QuantKind.Q4_1, QuantKind.Q5_0, QuantKind.Q5_1, QuantKind.Q8_0},
    QuantKind.Q4_1: {QuantKind.Q5_1},
    QuantKind.Q5_0: {QuantKind.Q5_1, QuantKind.Q8_0},
    QuantKind.Q5_1: set(),
    QuantKind.Q8_0: set(),
    QuantKind.Q4_K: {QuantKind.Q5_K},
    QuantKind.Q5_K: set(),
    QuantKind.Q6_K: set(),
    QuantKind.IQ4_NL: {QuantKind.Q8_0},
    QuantKind.Q3_K: {QuantKind.Q6_K},
    QuantKind.Q2_K: set(),
}
_BITS = {QuantKind.Q2_K: -2, QuantKind.Q3_K: -1, QuantKind.Q4_0: 0, QuantKind.IQ4_NL: 1, QuantKind.Q4_1: 1,
         QuantKind.Q4_K: 1, QuantKind.Q5_0: 2, QuantKind.Q5_1: 3, QuantKind.Q5_K: 3, QuantKind.Q6_K: 4,
         QuantKind.Q8_0: 5}  # fmt: skip
# in a mix with no exact common format
_TO_Q8_0 = {QuantKind.Q2_K, QuantKind.Q3_K, QuantKind.Q4_K, QuantKind.Q5_K, QuantKind.Q6_K, QuantKind.IQ4_NL}


def _common(kinds: set[QuantKind]) -> QuantKind:
    for kind in sorted(_BITS, key=_BITS.__getitem__):
        if all(k is kind or kind in _EXACT[k] for k in kinds):
            return kind
    return QuantKind.Q8_0 if kinds & _TO_Q8_0 else max(kinds, key=_BITS.__getitem__)


def same_format_for_fused(ck: Checkpoint) -> Checkpoint:
    """``ck`` with the members of each fused group in one format: all packed ones in the smallest format every
    one of them converts into exactly (Q4_0 -> Q4_1 / Q5_0 / Q5_1 / Q8_0, Q4_1 -> Q5_1, Q5_0 -> Q5_1 / Q8_0, Q4_K ->
    Q5_K, IQ4_NL -> Q8_0, Q3_K -> Q6_K), else the finest among them, the others requantized (Q4_1 / Q5_1 -> Q8_0; any
    other mix with a K-quant or IQ4_NL -> Q8_0; the error recorded in ``converted``); a group mixing dense and packed
    weights dequantised (no error)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in ck.tensors:
        for i, pattern in enumerate(_FUSED):
            if (m := pattern.fullmatch(name)) is not None:
                groups.setdefault((m.group(1), i), []).append(name)
    tensors, report = dict(ck.tensors), QuantReport()
    for names in groups.values():
        ws = [tensors[n] for n in names]
        kinds = {w.kind for w in ws if isinstance(w, Packed)}
        if len(kinds) == 0 or (len(kinds) == 1 and all(isinstance(w, Packed) for w in ws)):
            continue
        if not all(isinstance(w, Packed) for w in ws):
            for n, w in zip(names, ws, strict=True):
                tensors[n] = w.dequantize() if isinstance(w, Packed) else w
            continue
        kind = _common(kinds)
        for n, w in zip(names, ws, strict=True):
            if isinstance(w, Packed) and w.kind is not kind:
                tensors[n] = _as(w, kind)
                report.add(f"{w.kind.name}->{kind.name}", w.dequantize(), tensors[n])  # type: ignore[arg-type]
    if report.tensors:
        log.info("%s: fused weights brought to one format: %s", ck.name, report.summary())
    return Checkpoint(ck.config, tensors, ck.save_tokenizer, ck.name, {**ck.converted, **report.errors()})


def _as(w: Packed, kind: QuantKind) -> Packed:
    n, k = w.shape
    if w.kind is QuantKind.Q4_0 and kind is QuantKind.Q4_1 and bool((w.d.abs() < 8000).all()):
        return Packed(kind, w.qs, w.d, -8 * w.d)  # d (q - 8) = d q + (-8 d): exact in fp16
    if w.kind is QuantKind.Q4_0 and kind is QuantKind.Q5_0:  # q - 8 = (q + 8) - 16 with the same scale: exact
        return _q5(kind, w.d, w.quants() + 8)
    if w.kind is QuantKind.Q4_1 and kind is QuantKind.Q5_1:  # the same values, the 5th bits 0
        return _q5(kind, w.d, w.quants(), w.m)
    if w.kind is QuantKind.Q4_K and kind is QuantKind.Q5_K:  # the same scales and quants, the 5th bits 0
        return Packed(kind, w.qs, w.d, w.m, torch.zeros(n, k // 8, dtype=torch.uint8))
    offset = {QuantKind.Q4_0: 8, QuantKind.Q5_0: 16}.get(w.kind)
    if offset is not None and kind is QuantKind.Q5_1 and bool((w.d.abs() < 60000 / offset).all()):
        return _q5(kind, w.d, w.quants(), -offset * w.d)  # d (q - o) = d q + (-o d): exact in fp16
    if w.kind is QuantKind.Q3_K and kind is QuantKind.Q6_K:  # (q - 4) = (q + 28) - 32, the same scales: exact
        assert w.m is not None
        q = (w.quants() + 28).numpy()
        return q6_k(w.d.numpy(), w.m.numpy(), q)
    if w.kind is QuantKind.IQ4_NL and kind is QuantKind.Q8_0:  # the table's values, the same scale: exact
        return Packed(kind, IQ4_NL_VALUES[w.quants().long()].reshape(n, k), w.d)
    if w.kind in (QuantKind.Q4_0, QuantKind.Q5_0) and kind is QuantKind.Q8_0:  # the same scale: exact
        offset = 8 if w.kind is QuantKind.Q4_0 else 16
        return Packed(kind, (w.quants().to(torch.int16) - offset).to(torch.int8).reshape(n, k), w.d)
    return quantize_tensor(w.dequantize(), kind)


def _q5(kind: QuantKind, d: torch.Tensor, q: torch.Tensor, m: torch.Tensor | None = None) -> Packed:
    """Quants ``[N, K / 32, 32]`` in 0..31, their scales (and Q5_1's minimums) -> a Q5_0 / Q5_1 weight."""
    n, nb, _ = q.shape
    qs = (q[:, :, :16] & 0x0F) | ((q[:, :, 16:] & 0x0F) << 4)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    h = ((q >> 4).to(torch.int32).reshape(n, nb, 4, 8) * weights).sum(dim=3).to(torch.uint8)
    return Packed(kind, qs.reshape(n, nb * 16).contiguous(), d, m, h.reshape(n, nb * 4))

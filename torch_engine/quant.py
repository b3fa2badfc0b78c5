"""Quantized weights kept as a GGUF ships them: the engine's packed form, its reference dequantisation,
and the row / column cuts the builder's TP sharding needs.

A ``Packed`` weight of shape ``[N, K]`` is quantized in blocks of 32 along K, as llama.cpp's ``Q8_0``, ``Q6_K``,
``Q5_K``, ``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q4_0``, ``Q4_1``, ``IQ4_NL``, ``Q3_K`` and ``Q2_K`` are, but stored as
separate arrays (one sequential stream each for the kernels, and plain tensors for safetensors):

- ``qs``: the quants, ``[N, K]`` int8 (Q8_0) or ``[N, K / 2]`` uint8 (the others' low 4 bits: byte j of a block
  holds element j's in its low nibble and element j + 16's in its high one, Q4 / Q5's GGUF order); Q3_K: their low
  2 bits, ``[N, K / 4]`` (byte j of a block's 8 holds elements j, j + 8, j + 16, j + 24 at bits 0, 2, 4, 6); Q2_K:
  its 2-bit quants, likewise;
- ``d``: each block's scale, ``[N, K / 32]`` float16 (Q6_K, Q3_K: each super-block of 256's, ``[N, K / 256]``;
  Q4_K, Q5_K and Q2_K: each super-block's scale and minimum's scale, ``d`` then ``dmin``, ``[N, K / 128]``);
- ``m``: each block's minimum, ``[N, K / 32]`` float16 (Q4_1 and Q5_1); Q6_K and Q3_K: their sub-block scales, one
  per 16 weights, ``[N, K / 16]`` int8; Q4_K and Q5_K: each block's 6-bit scale and minimum, ``[N, K / 16]`` uint8;
  Q2_K: each 16 weights' 4-bit scale (low nibble) and minimum (high), ``[N, K / 16]`` uint8, as the file holds them;
- ``h``: the bits above the low 4 (Q3_K: the low 2), ``[N, K / 8]`` uint8 for Q5_0, Q5_1, Q5_K and Q3_K (a block's 4
  bytes, bit e of them element e's 5th (Q3_K: 3rd), GGUF's little-endian ``qh``), ``[N, K / 4]`` for Q6_K (a
  block's 8 bytes, bits 2e and 2e + 1 element e's 5th and 6th).

Element values: Q8_0 ``d * q``, Q6_K ``(d * sc) * (q - 32)``, Q3_K ``(d * sc) * (q - 4)``, Q5_0 ``d * (q - 16)``,
Q4_0 ``d * (q - 8)``, IQ4_NL ``d * IQ4_NL_VALUES[q]`` (a non-uniform int8 table; Q4_0's layout otherwise), Q4_1 and
Q5_1 ``d * q + m``, Q4_K, Q5_K and Q2_K ``(d * sc) * q - dmin * mn``, computed in fp32 exactly as
``gguf.quants.dequantize`` does (``dequantize`` here is bit-equal to it; the tests check).

The engine's fast CPU path computes with a ``Grouped`` copy (``group``, at load): the same quants
and scales with 16 output rows interleaved, the layout of the integer kernels
(``torch_engine/csrc/qgemm.h``), which multiply them with activations quantized to int8 per 32-block
as llama.cpp does. Their result differs from the dequantised weight's GEMM by the activations'
rounding only (each activation within half its block's step ``max|x| / 127``); the tests bound it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

BLOCK = 32
# IQ4_NL's 16 values (llama.cpp's ``kvalues_iq4nl``): a weight is its block's d times the one its 4-bit index picks
IQ4_NL_VALUES = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8
)
PACKED_KEY = "disagg.packed"  # a rank file's safetensors metadata: {weight name: QuantKind name}


class QuantKind(enum.IntEnum):
    """The GGML type ids of the block formats the engine computes with as stored."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20

    @property
    def block_weights(self) -> int:
        """Weights of one GGUF block (the K-quants: a super-block of 256), the finest cut along K."""
        k_quants = (QuantKind.Q2_K, QuantKind.Q3_K, QuantKind.Q4_K, QuantKind.Q5_K, QuantKind.Q6_K)
        return 256 if self in k_quants else BLOCK

    @property
    def two_level(self) -> bool:
        """Q4_K / Q5_K: a scale and a minimum per block of 32 (6 bits each) times a super-block's ``d`` / ``dmin``."""
        return self in (QuantKind.Q4_K, QuantKind.Q5_K)

    @property
    def d_weights(self) -> int:
        """Weights along K per column of ``Packed.d``."""
        return 256 if self.sub_scales else (128 if self.has_dmin else BLOCK)

    @property
    def has_dmin(self) -> bool:
        """Q4_K / Q5_K / Q2_K: a super-block's ``d`` and ``dmin`` (``Packed.d``), a 6-bit (Q2_K: 4-bit) scale and
        minimum per block (Q2_K: per 16 weights) in ``Packed.m``."""
        return self.two_level or self is QuantKind.Q2_K

    @property
    def sub_scales(self) -> bool:
        """Q6_K / Q3_K: a signed int8 scale per 16 weights (``Packed.m``) times a super-block's ``d``."""
        return self in (QuantKind.Q6_K, QuantKind.Q3_K)

    @property
    def low_bits(self) -> int:
        """Bits per weight in ``Packed.qs``: Q8_0 8, Q3_K and Q2_K 2, the others 4."""
        return {QuantKind.Q8_0: 8, QuantKind.Q3_K: 2, QuantKind.Q2_K: 2}.get(self, 4)

    @property
    def block_bytes(self) -> int:
        """Bytes of one GGUF block of ``block_weights`` (scale, [minimum,] [high bits,] quants)."""
        return {
            QuantKind.Q4_0: 18, QuantKind.Q4_1: 20, QuantKind.Q5_0: 22, QuantKind.Q5_1: 24, QuantKind.Q8_0: 34,
            QuantKind.Q4_K: 144, QuantKind.Q5_K: 176, QuantKind.Q6_K: 210, QuantKind.IQ4_NL: 18, QuantKind.Q3_K: 110,
            QuantKind.Q2_K: 84,
        }[self]  # fmt: skip

    @property
    def has_min(self) -> bool:
        return self in (QuantKind.Q4_1, QuantKind.Q5_1) or self.two_level

    @property
    def has_m(self) -> bool:
        """Whether ``Packed.m`` is stored: the minimums, Q6_K / Q3_K's sub-block scales, Q4_K / Q5_K / Q2_K's scales
        and minimums."""
        return self.has_min or self.sub_scales or self.has_dmin

    @property
    def high_bits(self) -> int:
        """Bits per weight stored apart above ``qs``'s (``Packed.h``): Q5's 5th, Q6_K's 5th and 6th, Q3_K's 3rd."""
        return {QuantKind.Q5_0: 1, QuantKind.Q5_1: 1, QuantKind.Q5_K: 1, QuantKind.Q6_K: 2, QuantKind.Q3_K: 1}.get(
            self, 0
        )

    @property
    def has_high(self) -> bool:
        return self.high_bits > 0


@dataclass(frozen=True, slots=True)
class Packed:
    """One quantized weight ``[N, K]`` (see the module docstring for the layout)."""

    kind: QuantKind
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    h: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * self.kind.d_weights

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.d, self.m, self.h) if t is not None]

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Packed:
        m, h = (None if t is None else fn(t) for t in (self.m, self.h))
        return Packed(self.kind, fn(self.qs), fn(self.d), m, h)

    def rows(self, index: torch.Tensor | slice) -> Packed:
        """The rows ``index`` (a slice, or a tensor of row numbers: a permutation, a gather)."""
        return self._map(lambda t: t[index])

    def columns(self, start: int, length: int) -> Packed:
        """Columns ``[start, start + length)``; both must fall on block boundaries (the K-quants: super-blocks)."""
        unit = self.kind.block_weights
        if start % unit or length % unit:
            raise ValueError(
                f"a {self.kind.name} weight can only be cut at multiples of {unit} columns, "
                f"not [{start}, {start + length})"
            )
        per_q = 8 // self.kind.low_bits
        per_m = 16 if self.kind.sub_scales or self.kind.has_dmin else BLOCK  # m: a byte each 16 weights

        def cut(t: torch.Tensor | None, per: int) -> torch.Tensor | None:  # per: weights per column of t
            return None if t is None else t[:, start // per : (start + length) // per].clone()

        qs, d = cut(self.qs, per_q), cut(self.d, self.kind.d_weights)
        assert qs is not None and d is not None
        m, h = cut(self.m, per_m), cut(self.h, 8 // max(self.kind.high_bits, 1))
        return Packed(self.kind, qs, d, m, h)

    def contiguous(self) -> Packed:
        return self._map(lambda t: t.contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[N, K]`` (fp32 arithmetic, as gguf's dequantisation; then ``dtype``)."""
        n, k = self.shape
        nb = k // BLOCK
        if self.kind.sub_scales:  # as gguf: (d * sc) per 16 weights, times q - 32 (Q3_K: q - 4)
            assert self.m is not None
            scale = self.d.float().repeat_interleave(16, dim=1) * self.m.float()
            offset = 32 if self.kind is QuantKind.Q6_K else 4
            q = (self.quants().to(torch.int16) - offset).float().reshape(n, k // 16, 16)
            return (scale.reshape(n, k // 16, 1) * q).reshape(n, k).to(dtype)
        if self.kind is QuantKind.Q2_K:  # as gguf: (d * sc) * q - dmin * mn, per 16 weights
            assert self.m is not None
            ds = self.d.float().reshape(n, k // 256, 2, 1)
            sm = self.m.reshape(n, k // 256, 16)
            scale, minimum = ds[:, :, 0] * (sm & 0x0F).float(), ds[:, :, 1] * (sm >> 4).float()  # [n, k / 256, 16]
            q = self.quants().float().reshape(n, k // 16, 16)
            return (scale.reshape(n, k // 16, 1) * q - minimum.reshape(n, k // 16, 1)).reshape(n, k).to(dtype)
        if self.kind.two_level:  # as gguf: (d * sc) * q - dmin * mn
            assert self.m is not None
            ds = self.d.float().reshape(n, k // 256, 2)
            sm = self.m.float().reshape(n, k // 256, 8, 2)
            scale, minimum = ds[:, :, :1] * sm[..., 0], ds[:, :, 1:] * sm[..., 1]  # [n, k / 256, 8]
            w = scale.reshape(n, nb, 1) * self.quants().float() - minimum.reshape(n, nb, 1)
            return w.reshape(n, k).to(dtype)
        d = self.d.float().reshape(n, nb, 1)
        if self.kind is QuantKind.Q8_0:
            w = self.qs.reshape(n, nb, BLOCK).float() * d
        elif self.m is not None:  # Q4_1, Q5_1
            w = d * self.quants().float() + self.m.float().reshape(n, nb, 1)
        elif self.kind is QuantKind.IQ4_NL:
            w = d * IQ4_NL_VALUES.to(self.d.device)[self.quants().long()].float()
        else:
            w = d * (self.quants().float() - (16 if self.kind is QuantKind.Q5_0 else 8))
        return w.reshape(n, k).to(dtype)

    def quants(self) -> torch.Tensor:
        """A Q3 / Q4 / Q5 / Q6_K weight's unsigned quants ``[N, K / 32, 32]`` (uint8, GGUF's element order; the
        high bits included)."""
        n, k = self.shape
        low = self.kind.low_bits
        if low == 2:  # byte j of a block's 8: elements j + 8 t at bits 2 t
            crumbs = self.qs.reshape(n, k // BLOCK, 1, 8) >> torch.arange(0, 8, 2, dtype=torch.uint8).reshape(4, 1)
            q = (crumbs & 3).reshape(n, k // BLOCK, BLOCK)
        else:
            raw = self.qs.reshape(n, k // BLOCK, BLOCK // 2)
            q = torch.cat((raw & 0x0F, raw >> 4), dim=2)
        if self.h is not None:
            planes = self.kind.high_bits  # a byte of h holds 8 / planes elements' bits
            shifts = torch.arange(0, 8, planes, dtype=torch.uint8, device=self.h.device)
            bits = self.h.reshape(n, k // BLOCK, 4 * planes, 1) >> shifts
            q = q | ((bits & ((1 << planes) - 1)).reshape(n, k // BLOCK, BLOCK) << low)
        return q

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The safetensors entries of this weight under ``name``."""
        out = {f"{name}.qs": self.qs, f"{name}.d": self.d}
        if self.m is not None:  # (minimums, or Q6_K / Q3_K's sub-block scales)
            out[f"{name}.m"] = self.m
        if self.h is not None:
            out[f"{name}.h"] = self.h
        return out

    @classmethod
    def from_tensors(cls, kind: QuantKind, name: str, state: dict[str, torch.Tensor]) -> Packed:
        """The weight ``name`` out of a loaded state dict (its entries are removed from it)."""
        m = state.pop(f"{name}.m") if kind.has_m else None
        h = state.pop(f"{name}.h") if kind.has_high else None
        return cls(kind, state.pop(f"{name}.qs"), state.pop(f"{name}.d"), m, h)


@dataclass(frozen=True, slots=True)
class Grouped:
    """A ``Packed`` weight ``[n, k]`` repacked for the integer kernels (``csrc/qgemm.h``): quants
    ``qs`` in groups of 16 interleaved output rows, scales ``d`` / minimums ``m`` ``[groups, k / 32, 16]``
    (``m`` empty unless Q4_1 / Q5_1; Q6_K and Q3_K: ``d`` ``[groups, k / 256, 16]``, ``m`` their sub-block scales
    ``[groups, k / 32, 32]`` int8; Q4_K / Q5_K: ``d`` ``[groups, k / 128, 16]`` (d, dmin), ``m`` ``[groups, k / 32,
    32]`` uint8, the block's 16 scales then its 16 minimums; Q2_K: ``d`` as Q4_K's, ``m`` ``[groups, k / 32, 32]``
    uint8, each half block's scale and minimum in one byte)."""

    kind: QuantKind
    n: int
    k: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> list[torch.Tensor]:
        return [self.qs, self.d, self.m]

    def gemm(self, kernels: ModuleType, x: torch.Tensor, bias: torch.Tensor, precise: bool = False) -> torch.Tensor:
        """``x @ W.T + bias`` on the integer kernel (``x`` ``[R, k]`` fp32 or bf16; ``bias`` may be empty).
        ``precise``: the activations' rounding residual is multiplied too (twice the dot products, ~250x less
        error; the lm_head's choice)."""
        return kernels.gemm_q8(x, int(self.kind), self.qs, self.d, self.m, self.n, bias, precise)

    def rows(self, kernels: ModuleType, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all if None) dequantised to fp32, as ``Packed.dequantize`` gives them."""
        which = ids if ids is not None else _NO_IDS
        return kernels.rows_q16(int(self.kind), self.qs, self.d, self.m, self.n, which)


_NO_IDS = torch.empty(0, dtype=torch.long)


def group(p: Packed, kernels: ModuleType) -> Grouped:
    """``p`` repacked for the integer kernels (done once, at load)."""
    n, k = p.shape
    m = p.m if p.m is not None else torch.empty(0, dtype=torch.float16)
    h = p.h if p.h is not None else torch.empty(0, dtype=torch.uint8)
    qs, d, mm = kernels.repack_q16(int(p.kind), p.qs.contiguous(), p.d.contiguous(), m.contiguous(), h.contiguous())
    return Grouped(p.kind, n, k, qs, d, mm)


Weight = torch.Tensor | Packed  # a checkpoint's tensor: dense, or kept as stored


def narrow(w: Weight, dim: int, start: int, length: int) -> Weight:
    """``w.narrow(dim, start, length)``, copied, for dense and packed weights alike."""
    if isinstance(w, Packed):
        return w.rows(slice(start, start + length)) if dim == 0 else w.columns(start, length)
    return w.narrow(dim, start, length).clone()


def cat_rows(ws: Sequence[Weight]) -> Weight:
    """Weights stacked along their output rows (q, k, v -> qkv); all dense, or all packed of one kind."""
    if all(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat([w for w in ws if isinstance(w, torch.Tensor)])
    packed = [w for w in ws if isinstance(w, Packed)]
    kinds = {p.kind for p in packed}
    if len(packed) != len(ws) or len(kinds) != 1:
        raise ValueError(f"cannot fuse weights stored differently ({sorted(k.name for k in kinds)} and dense)")
    kind = kinds.pop()
    m = torch.cat([p.m for p in packed if p.m is not None]) if kind.has_m else None
    h = torch.cat([p.h for p in packed if p.h is not None]) if kind.has_high else None
    return Packed(kind, torch.cat([p.qs for p in packed]), torch.cat([p.d for p in packed]), m, h)

"""GGUF's block formats read into the engine's packed form (``torch_engine/quant.py``): a tensor's raw blocks, as
``GGUFReader`` maps them, split into the arrays ``Packed`` holds (``from_gguf_blocks``), bit for bit; and the K-quants'
packed forms built from their parts (``q6_k``, ``q3_k``: the builder's exact conversions and encoders use them).

Per format: Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL blocks of 32 (scale first), Q6_K (``_from_q6_k``), Q3_K
(``_from_q3_k``), Q2_K (``_from_q2_k``) and Q4_K / Q5_K (``_from_k4``) super-blocks of 256; the element order of each
array is ``Packed``'s (see ``torch_engine/quant.py``'s docstring).
"""

from __future__ import annotations

import numpy as np
import torch

from torch_engine.quant import BLOCK, Packed, QuantKind


def from_gguf_blocks(kind: QuantKind, raw: np.ndarray, shape: tuple[int, int]) -> Packed:
    """A GGUF tensor's raw bytes (``[N, K / 32 * block_bytes]`` uint8, as ``GGUFReader`` maps them)
    -> the packed form. ``shape`` is ``[N, K]``."""
    n, k = shape
    if k % kind.block_weights:
        raise ValueError(f"a {kind.name} tensor needs a multiple of {kind.block_weights} columns, got {k}")
    if kind is QuantKind.Q6_K:
        return _from_q6_k(np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, 210), n, k)
    if kind is QuantKind.Q3_K:
        return _from_q3_k(np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, 110), n, k)
    if kind is QuantKind.Q2_K:
        return _from_q2_k(np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, 84), n, k)
    if kind.two_level:
        return _from_k4(kind, np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, kind.block_bytes), n, k)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, kind.block_bytes)
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)).reshape(n, k // BLOCK)
    if kind is QuantKind.Q8_0:
        qs = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).reshape(n, k)
        return Packed(kind, qs, d)
    at = 4 if kind.has_min else 2  # a block: d, [m,] [qh (4 bytes),] qs
    first = at + 4 if kind.has_high else at
    qs = torch.from_numpy(blocks[:, :, first:].copy()).reshape(n, k // 2)
    m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)).reshape(n, k // BLOCK) if kind.has_min else None
    h = torch.from_numpy(blocks[:, :, at:first].copy()).reshape(n, k // 8) if kind.has_high else None
    return Packed(kind, qs, d, m, h)


def _from_q6_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    """Q6_K super-blocks ``[N, K / 256, 210]`` (ql: 128 bytes of low nibbles, qh: 64 bytes of 2-bit pairs, 16 int8
    scales, d) -> the packed form (gguf's element order: ``ql`` byte 64 h + i holds elements 128 h + i (low nibble)
    and 128 h + 64 + i (high); ``qh`` byte 32 h + i the top bits of elements 128 h + 32 s + i at bits 2 s)."""
    sb = blocks.shape[1]
    ql = blocks[:, :, :128].reshape(n, sb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = blocks[:, :, 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = (ql & 0x0F).reshape(n, k // BLOCK, BLOCK) | ((qh & 0x03).reshape(n, k // BLOCK, BLOCK) << 4)
    sc = blocks[:, :, 192:208].copy().view(np.int8).reshape(n, k // 16)
    return q6_k(blocks[:, :, 208:210].copy().view(np.float16).reshape(n, sb), sc, q)


def q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> Packed:
    """A Q6_K weight out of its parts: ``d`` ``[N, K / 256]`` float16, the sub-block scales ``sc`` ``[N, K / 16]``
    int8 and the quants ``q`` ``[N, K / 32, 32]`` uint8 in 0..63 (element order; each weight ``(d * sc) * (q -
    32)``)."""
    n, nb, _ = q.shape
    qs = (q[:, :, :16] & 0x0F) | ((q[:, :, 16:] & 0x0F) << 4)  # byte j: element j | element j + 16 << 4
    h = ((q >> 4).reshape(n, nb, 8, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)).sum(axis=3, dtype=np.uint8)
    return _of_arrays(QuantKind.Q6_K, qs.reshape(n, nb * 16), d, sc, h.reshape(n, nb * 8))


def _from_q3_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    """Q3_K super-blocks ``[N, K / 256, 110]`` (hmask: 32 bytes, bit b of byte i element 32 b + i's 3rd bit, set
    for the upper half of -4..3; qs: 64 bytes, byte 32 h + i holds elements 128 h + 32 s + i at bits 2 s; 12 bytes
    of 6-bit scales, offset 32: the low 4 bits of scales j and j + 8 in byte j, the top 2 of scale 4 s + i at bits 2 s
    of byte 8 + i; d) -> the packed form."""
    sb = blocks.shape[1]
    hmask, qs, scales = blocks[:, :, 0:32], blocks[:, :, 32:96], blocks[:, :, 96:108]
    low = (scales[:, :, 0:8].reshape(n, sb, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (scales[:, :, 8:12].reshape(n, sb, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    sc = (low.reshape(n, sb, 16) | (high.reshape(n, sb, 16) << 4)).astype(np.int8) - np.int8(32)
    two = (qs.reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    third = (hmask.reshape(n, sb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = two.reshape(n, sb, 8, 32) | (third << 2)  # q - 4 = two - 4 (1 - third)
    d = blocks[:, :, 108:110].copy().view(np.float16).reshape(n, sb)
    return q3_k(d, sc.reshape(n, k // 16), q.reshape(n, k // 32, 32).astype(np.uint8))


def q3_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> Packed:
    """A Q3_K weight out of its parts: ``d`` ``[N, K / 256]`` float16, the sub-block scales ``sc`` ``[N, K / 16]``
    int8 (-32..31 in a file) and the quants ``q`` ``[N, K / 32, 32]`` uint8 in 0..7 (element order; each weight
    ``(d * sc) * (q - 4)``)."""
    n, nb, _ = q.shape
    qs = ((q & 3).reshape(n, nb, 4, 8) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)).sum(
        axis=2, dtype=np.uint8
    )  # byte j: elements j + 8 t at bits 2 t
    h = (((q >> 2) & 1).reshape(n, nb, 4, 8) << np.arange(8, dtype=np.uint8)).sum(axis=3, dtype=np.uint8)
    return _of_arrays(QuantKind.Q3_K, qs.reshape(n, nb * 8), d, sc, h.reshape(n, nb * 4))


def _of_arrays(kind: QuantKind, qs: np.ndarray, d: np.ndarray, m: np.ndarray, h: np.ndarray | None = None) -> Packed:
    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    return Packed(kind, t(qs), t(d), t(m), None if h is None else t(h))


def _from_q2_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    """Q2_K super-blocks ``[N, K / 256, 84]`` (16 bytes: each 16 weights' 4-bit scale (low nibble) and minimum
    (high); qs: 64 bytes, byte 32 h + i holds elements 128 h + 32 s + i at bits 2 s; d; dmin) -> the packed form."""
    sb = blocks.shape[1]
    scales, qs = blocks[:, :, 0:16], blocks[:, :, 16:80]
    two = (qs.reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    crumbs = (two.reshape(n, k // 32, 4, 8) << np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)).sum(
        axis=2, dtype=np.uint8
    )  # byte j of a block: elements j + 8 t at bits 2 t
    d = blocks[:, :, 80:84].copy().view(np.float16).reshape(n, sb * 2)  # d, dmin per super-block
    return _of_arrays(QuantKind.Q2_K, crumbs.reshape(n, k // 4), d, scales.reshape(n, k // 16))


def _from_k4(kind: QuantKind, blocks: np.ndarray, n: int, k: int) -> Packed:
    """Q4_K / Q5_K super-blocks ``[N, K / 256, 144 or 176]`` (d, dmin, 12 bytes of 6-bit scales and minimums,
    [qh: 32 bytes, bit s of byte i element 32 s + i's 5th,] qs: byte 32 c + i holds elements 64 c + i (low nibble) and
    64 c + 32 + i (high)) -> the packed form."""
    sb = blocks.shape[1]
    d = blocks[:, :, 0:4].copy().view(np.float16).reshape(n, sb * 2)  # d, dmin per super-block
    sc, mn = scale_min_k4(blocks[:, :, 4:16].reshape(n * sb, 12))  # [n * sb, 8] each
    m = np.stack([sc, mn], axis=2).astype(np.uint8).reshape(n, k // 16)
    at = 48 if kind is QuantKind.Q5_K else 16
    ql = blocks[:, :, at:].reshape(n, sb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (ql & 0x0F).reshape(n, k // BLOCK, BLOCK)
    qs = low[:, :, :16] | (low[:, :, 16:] << 4)  # byte j: element j | element j + 16 << 4
    h = None
    if kind is QuantKind.Q5_K:
        bits = blocks[:, :, 16:48].reshape(n, sb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        top = (bits & 1).reshape(n, k // BLOCK, 4, 8)  # [block][byte][bit]: element 8 byte + bit
        h = torch.from_numpy((top << np.arange(8, dtype=np.uint8)).sum(axis=3, dtype=np.uint8).reshape(n, k // 8))
    return Packed(
        kind, torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2)), torch.from_numpy(d), torch.from_numpy(m), h
    )


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes per super-block -> 8 scales and 8 minimums of 6 bits (llama.cpp's
    ``get_scale_min_k4``: the first four in the low 6 bits of bytes 0-3 / 4-7, the last four split
    over bytes 8-11 and the top bits of bytes 0-7)."""
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc, mn

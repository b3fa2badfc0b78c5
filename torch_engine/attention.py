"""Paged attention over the per-layer pools, for a step that mixes decodes and prefill chunks.

The model runner flattens every scheduled token of a step into one ``[T, ...]`` batch and
describes it once per step with ``AttentionMetadata``: where each token's KV goes (page,
offset), one batched group for all single-token (decode) rows, and one segment per prefill
chunk. Each layer then writes its new KV into the pages and attends over the gathered pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    start: int  # first row of the chunk in the flattened batch
    end: int
    page_table: torch.Tensor  # [1, M]
    mask: torch.Tensor  # [1, 1, L, M * page_size] bool: True = attend
    first: int = 0  # the chunk's first position (keys before it are the sequence's earlier tokens)


@dataclass(slots=True)
class AttentionMetadata:
    slot_pages: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, rot_dim // 2]
    sin: torch.Tensor
    decode_rows: torch.Tensor | None = None  # [B] rows of the flattened batch
    decode_page_table: torch.Tensor | None = None  # [B, M]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, M * page_size]
    decode_kv_lens: torch.Tensor | None = None  # [B] tokens of KV per decode row (the fused kernel's mask)
    prefills: list[PrefillSegment] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        """Every row is a single-token decode, in row order (the steady state of a decode node)."""
        return not self.prefills and self.decode_rows is not None


def context_mask(q_start: int, q_len: int, kv_len: int, width: int, device: torch.device) -> torch.Tensor:
    """Causal mask of ``q_len`` queries at positions ``q_start..`` over ``width`` gathered keys."""
    keys = torch.arange(width, device=device)[None, :]
    queries = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    return ((keys <= queries) & (keys < kv_len))[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with grouped KV heads: q ``[B, Hq, L, D]``, k/v ``[B, Hkv, S, D]`` -> ``[B, Hq, L, Dv]``.

    Single-query rows (decode) take a plain matmul path that groups the query heads of each KV
    head instead of repeating K and V; chunks of several queries use SDPA (flash on CPU).
    """
    b, hq, length, _ = q.shape
    hkv = k.shape[1]
    if length == 1:
        # (head, sequence)-batched matmuls; K/V from gather_kv are head-major, so no copy here.
        # fp32 math: the tensors are small, and CPUs without native bf16 run fp32 matmuls faster.
        kk, vv = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [Hkv, B, S, D]
        qg = q.reshape(b, hkv, hq // hkv, q.shape[-1]).transpose(0, 1).float()  # [Hkv, B, G, D]
        scores = torch.matmul(qg, kk.transpose(-1, -2)) * scale  # [Hkv, B, G, S]
        scores.masked_fill_(~mask.view(1, b, 1, -1), float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), vv)  # [Hkv, B, G, Dv]
        return out.transpose(0, 1).reshape(b, hq, 1, v.shape[-1]).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence over page-major K/V, without first reassembling each sequence.

    q ``[B, Hq, D]``; k/v ``[B, M, Hkv, P, D]`` (``M`` pages of ``P`` tokens, from
    ``PagedKVCache.gather_pages_kv``); mask ``[B, 1, 1, M * P]`` (True = attend). Scores are
    computed page by page in one batched matmul, the softmax runs over all pages of a sequence,
    and the weighted values are summed over pages. Math in fp32 (CPUs without native bf16 run
    fp32 matmuls faster; the tensors are small).
    """
    b, m, hkv, p, d = k.shape
    hq = q.shape[1]
    g = hq // hkv
    qq = q.reshape(b, 1, hkv, g, d).float().expand(b, m, hkv, g, d)
    scores = torch.matmul(qq, k.float().transpose(-1, -2))  # [B, M, Hkv, G, P]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(b, hkv, g, m * p) * scale
    scores.masked_fill_(~mask.view(b, 1, 1, m * p), float("-inf"))
    probs = scores.softmax(dim=-1).view(b, hkv, g, m, p).permute(0, 3, 1, 2, 4)  # [B, M, Hkv, G, P]
    out = torch.matmul(probs, v.float()).sum(dim=1)  # [B, Hkv, G, Dv]
    return out.reshape(b, hq, v.shape[-1]).to(q.dtype)


DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PrefillFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor | None]


def paged_attention(
    q: torch.Tensor,
    meta: AttentionMetadata,
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    v_dim: int,
    decode: DecodeFn | None = None,
    prefill: PrefillFn | None = None,
) -> torch.Tensor:
    """Attention of every row of ``q`` (``[T, Hq, D]``) over its sequence's pages -> ``[T, Hq, v_dim]``.

    ``gather(page_table)`` returns the K and V (``[B, Hkv, S, D]``) of the sequences in a page
    table. ``decode(q_rows, page_table, mask)``, if given, computes the single-query rows
    (``[B, Hq, D]`` -> ``[B, Hq, v_dim]``); by default they go through ``gather`` and ``attend``.
    ``prefill(q_chunk, page_table, first)``, if given, computes a prefill chunk (``[L, Hq, D]`` at
    positions ``first..``, causal) or returns None, and the chunk goes through ``gather`` and ``attend``.
    """
    if decode is None:

        def decode(qd: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            k, v = gather(table)
            return attend(qd.unsqueeze(2), k, v, mask, scale).squeeze(2)

    table, mask = meta.decode_page_table, meta.decode_mask
    if meta.decode_only and table is not None and mask is not None:
        return decode(q, table, mask)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    if meta.decode_rows is not None and table is not None and mask is not None:
        out[meta.decode_rows] = decode(q[meta.decode_rows], table, mask)
    for seg in meta.prefills:
        chunk = q[seg.start : seg.end]
        fused = prefill(chunk, seg.page_table, seg.first) if prefill is not None else None
        if fused is not None:
            out[seg.start : seg.end] = fused
            continue
        k, v = gather(seg.page_table)
        o = attend(chunk.transpose(0, 1).unsqueeze(0), k, v, seg.mask, scale)
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    return out

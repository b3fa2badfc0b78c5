"""Paged attention over the per-layer pools, for a step that mixes decodes and prefill chunks.

The model runner flattens every scheduled token of a step into one ``[T, ...]`` batch and
describes it once per step with ``AttentionMetadata``: where each token's KV goes (page,
offset), one batched group for all single-token (decode) rows, and one segment per prefill
chunk. Each layer then writes its new KV into the pages and attends over the gathered pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    start: int  # first row of the chunk in the flattened batch
    end: int
    page_table: torch.Tensor  # [1, M]
    mask: torch.Tensor  # [1, 1, L, M * page_size] bool: True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_pages: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, rot_dim // 2]
    sin: torch.Tensor
    decode_rows: torch.Tensor | None = None  # [B] rows of the flattened batch
    decode_page_table: torch.Tensor | None = None  # [B, M]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, M * page_size]
    prefills: list[PrefillSegment] = field(default_factory=list)


def context_mask(q_start: int, q_len: int, kv_len: int, width: int, device: torch.device) -> torch.Tensor:
    """Causal mask of ``q_len`` queries at positions ``q_start..`` over ``width`` gathered keys."""
    keys = torch.arange(width, device=device)[None, :]
    queries = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    return ((keys <= queries) & (keys < kv_len))[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with grouped KV heads: q ``[B, Hq, L, D]``, k/v ``[B, Hkv, S, D]``."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

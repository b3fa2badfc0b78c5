"""Reference KV content for messenger tests: one logical KV per page, sliced per rank and layout."""

from __future__ import annotations

import numpy as np

from kv_messenger.layout import AttentionKind, KVLayoutSpec
from torch_engine.config import KVLayout


def logical_pages(spec: KVLayoutSpec, num_pages: int, seed: int) -> np.ndarray:
    """Random bytes of the whole model's KV per page: GQA ``[N, H, 2, P, D*es]``, MLA ``[N, P, L*es]``."""
    rng = np.random.default_rng(seed)
    es = spec.element_size
    if spec.kind is AttentionKind.MLA:
        return rng.integers(0, 256, (num_pages, spec.page_size, spec.latent_dim * es), dtype=np.uint8)
    return rng.integers(0, 256, (num_pages, spec.kv_heads, 2, spec.page_size, spec.head_dim * es), dtype=np.uint8)


def rank_pages(logical: np.ndarray, spec: KVLayoutSpec, rank: int) -> np.ndarray:
    """What ``rank``'s pool holds for these pages, as ``[N, page_bytes]`` bytes in its layout."""
    n = logical.shape[0]
    if spec.kind is AttentionKind.MLA:
        return np.ascontiguousarray(logical.reshape(n, -1))
    heads = spec.heads_of(rank)
    mine = logical[:, heads.start : heads.stop]  # [N, h, 2, P, D]
    if spec.layout is KVLayout.NHD:
        mine = mine.transpose(0, 3, 1, 2, 4)  # [N, P, h, 2, D]
    return np.ascontiguousarray(mine.reshape(n, -1))

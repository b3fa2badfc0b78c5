"""A prefill group and a decode group of messenger sides over random KV pools, driven step by step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from kv_messenger.layout import AttentionKind, KVLayoutSpec
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.protocol import PrefillRequest
from tests.kv_reference import logical_pages, rank_pages
from torch_engine.config import DType, KVLayout

NUM_PAGES = 48
LAYERS = 3


class FakeProgress:
    """Stands in for the engine's LayerProgress: the test finishes layers by hand."""

    def __init__(self, layers: int) -> None:
        self.counts = [0] * layers

    def completed(self, layer: int) -> int:
        return self.counts[layer]


def spec(kind: AttentionKind, layout: KVLayout, page_size: int, tp: int, rank: int = 0) -> KVLayoutSpec:
    extra = {"kv_heads": 4, "head_dim": 8} if kind is AttentionKind.GQA else {"latent_dim": 12}
    return KVLayoutSpec(
        kind=kind,
        num_layers=LAYERS,
        page_size=page_size,
        layout=layout,
        dtype=DType.BFLOAT16,
        tp_size=tp,
        tp_rank=rank,
        **extra,
    )


def make_pools(layout: KVLayoutSpec, logical: list[np.ndarray] | None) -> list[torch.Tensor]:
    """One ``[NUM_PAGES, page_bytes]`` byte pool per layer, filled from the logical KV (or zeros)."""
    pools = []
    for layer in range(LAYERS):
        if logical is None:
            pools.append(torch.zeros(NUM_PAGES, layout.page_bytes, dtype=torch.uint8))
        else:
            pools.append(torch.from_numpy(rank_pages(logical[layer], layout, layout.tp_rank).copy()))
    return pools


@dataclass
class Scenario:
    kind: AttentionKind
    layout: KVLayout
    page_size: int
    prefill_tp: int
    decode_tp: int
    prompt_len: int = 40
    chunk: int = 7
    seed: int = 0

    def logical(self) -> list[np.ndarray]:
        base = spec(self.kind, self.layout, self.page_size, 1)
        return [logical_pages(base, NUM_PAGES, self.seed * 100 + layer) for layer in range(LAYERS)]

    def pages(self) -> tuple[list[int], list[int]]:
        n = -(-(self.prompt_len - 1) // self.page_size)
        rng = random.Random(self.seed)
        return rng.sample(range(NUM_PAGES), n), rng.sample(range(NUM_PAGES), n)

    def chunks(self) -> list[int]:
        """Tokens of KV done after each chunk (the prefill computes [0, n-1))."""
        total = self.prompt_len - 1
        return [*list(range(self.chunk, total, self.chunk)), total]

    def expected_dst(self, logical: list[np.ndarray], rank: int) -> tuple[list[np.ndarray], list[int]]:
        """What decode ``rank``'s pages must hold, per layer, for the destination pages."""
        src_pages, dst_pages = self.pages()
        d = spec(self.kind, self.layout, self.page_size, self.decode_tp, rank)
        return [rank_pages(logical[layer], d, rank)[src_pages] for layer in range(LAYERS)], dst_pages


def drive(
    prefills: list[PrefillSide], progress: list[FakeProgress], req: PrefillRequest, scenario: Scenario,
    submit: bool = True,
) -> None:  # fmt: skip
    """Submit (unless done already), schedule each chunk, then finish its layers one by one, polling
    the messengers in between."""
    src_pages, _ = scenario.pages()
    for p in prefills:
        if submit:
            p.submit(req)
    chunks = scenario.chunks()
    for step, done in enumerate(chunks, start=1):
        for p in prefills:
            p.schedule(req.request_id, step, done, step == len(chunks), src_pages)
        for layer in range(LAYERS):
            for pr in progress:
                pr.counts[layer] = step
            for p in prefills:
                p.poll_once()

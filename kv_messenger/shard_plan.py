"""The shard plan: which contiguous byte ranges move from which prefill rank to which decode rank.

A pure function of the two sides' layouts (TP sizes may differ), the page pairs to move and a
seed. Pages are moved whole; page ``i`` of the prefill side lands in page ``i`` of the decode
side. One plan covers one layer; every layer moves the same ranges of its own pool.

- GQA, HND pages ``[head, k/v, token, dim]``: a run of heads is one contiguous range, so a
  (page, source rank, destination rank) pair is one write.
- GQA, NHD pages ``[token, head, k/v, dim]``: the same heads are one range per token, so a
  pair is ``page_size`` writes.
- Equal TP: rank i sends to rank i. Prefill TP > decode TP: a decode rank's page is rebuilt
  from several senders' head ranges. Decode TP > prefill TP: a sender's page is split across
  receivers. TP > KV heads: a head lives on several ranks; each receiver takes it from one
  replica, chosen by ``(seed + receiver) % replicas`` to spread load.
- MLA: the latent is the same on every rank; every decode rank receives whole pages from
  the source replica ``(seed + receiver) % prefill_tp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_messenger.layout import AttentionKind, KVLayoutSpec, check_compatible
from torch_engine.config import KVLayout


@dataclass(frozen=True, slots=True)
class PageWrite:
    src_rank: int
    src_page: int
    src_offset: int  # bytes from the start of the source page
    dst_rank: int
    dst_page: int
    dst_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Writes of one layer, and how many of them each decode rank receives per layer."""

    writes: tuple[PageWrite, ...]
    expected: tuple[int, ...]  # indexed by decode rank

    def for_source(self, rank: int) -> list[PageWrite]:
        return [w for w in self.writes if w.src_rank == rank]


def _source_for_head(src: KVLayoutSpec, head: int, receiver: int, seed: int) -> int:
    h, t = src.kv_heads, src.tp_size
    if t <= h:
        return head // (h // t)
    replicas = t // h
    return head * replicas + (seed + receiver) % replicas


def _head_runs(src: KVLayoutSpec, dst: KVLayoutSpec, d: int, seed: int) -> list[tuple[int, int, int]]:
    """(source rank, first head, head count) runs covering the heads decode rank ``d`` holds."""
    runs: list[tuple[int, int, int]] = []
    for head in dst.heads_of(d):
        s = _source_for_head(src, head, d, seed)
        if runs and runs[-1][0] == s and runs[-1][1] + runs[-1][2] == head:
            runs[-1] = (s, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, head, 1))
    return runs


def plan_writes(
    src: KVLayoutSpec, dst: KVLayoutSpec, page_pairs: Sequence[tuple[int, int]], seed: int = 0
) -> ShardPlan:
    """Writes that move ``page_pairs`` (source page id, destination page id) for every decode rank."""
    check_compatible(src, dst)
    writes: list[PageWrite] = []
    expected = [0] * dst.tp_size
    src_heads = [src.heads_of(s) for s in range(src.tp_size)] if src.kind is AttentionKind.GQA else []
    for d in range(dst.tp_size):
        before = len(writes)
        if src.kind is AttentionKind.MLA:
            s, pb = (seed + d) % src.tp_size, src.page_bytes
            writes += [PageWrite(s, sp, 0, d, dp, 0, pb) for sp, dp in page_pairs]
        else:
            hb, p = src.head_bytes, src.page_size
            d_heads = dst.heads_of(d)
            for s, first, count in _head_runs(src, dst, d, seed):
                s_local, d_local = first - src_heads[s].start, first - d_heads.start
                s_n, d_n = len(src_heads[s]), len(d_heads)
                if src.layout is KVLayout.HND:  # [head, k/v, token, dim]: one range
                    so, do, n = s_local * p * hb, d_local * p * hb, count * p * hb
                    writes += [PageWrite(s, sp, so, d, dp, do, n) for sp, dp in page_pairs]
                else:  # [token, head, k/v, dim]: one range per token
                    writes += [
                        PageWrite(s, sp, (t * s_n + s_local) * hb, d, dp, (t * d_n + d_local) * hb, count * hb)
                        for sp, dp in page_pairs
                        for t in range(p)
                    ]
        expected[d] = len(writes) - before
    return ShardPlan(tuple(writes), tuple(expected))

"""Property tests of the shard plan: exact coverage, correct bytes, counts, write granularity."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_messenger.layout import AttentionKind, IncompatibleLayoutError, KVLayoutSpec
from kv_messenger.shard_plan import plan_writes
from tests.kv_reference import logical_pages, rank_pages
from torch_engine.config import DType, KVLayout


@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[KVLayoutSpec, KVLayoutSpec, list[tuple[int, int]], int]:
    kind = draw(st.sampled_from(list(AttentionKind)))
    ts, td = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    layout = draw(st.sampled_from(list(KVLayout)))
    page = draw(st.sampled_from([1, 2, 16]))
    common: dict[str, Any] = {"kind": kind, "num_layers": 2, "page_size": page, "layout": layout, "dtype": "bfloat16"}
    if kind is AttentionKind.GQA:
        common |= {"kv_heads": draw(st.sampled_from([1, 2, 4, 8])), "head_dim": draw(st.sampled_from([2, 4]))}
    else:
        common |= {"latent_dim": draw(st.sampled_from([3, 8]))}
    src = KVLayoutSpec(tp_size=ts, **common)
    dst = KVLayoutSpec(tp_size=td, **common)
    n = draw(st.integers(1, 5))
    src_pages = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True))
    dst_pages = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True))
    return src, dst, list(zip(src_pages, dst_pages, strict=True)), draw(st.integers(0, 1000))


@settings(max_examples=300, deadline=None)
@given(plan_cases())
def test_plan_moves_the_right_bytes_exactly_once(case) -> None:
    src, dst, pairs, seed = case
    plan = plan_writes(src, dst, pairs, seed)
    logical = logical_pages(src, 8, seed)
    src_pools = [rank_pages(logical, src, s) for s in range(src.tp_size)]
    dst_pools = [np.zeros((8, dst.for_rank(d).page_bytes), dtype=np.uint8) for d in range(dst.tp_size)]
    coverage = [np.zeros_like(p, dtype=np.int32) for p in dst_pools]
    for w in plan.writes:
        chunk = src_pools[w.src_rank][w.src_page, w.src_offset : w.src_offset + w.length]
        assert len(chunk) == w.length  # inside the source page
        dst_pools[w.dst_rank][w.dst_page, w.dst_offset : w.dst_offset + w.length] = chunk
        coverage[w.dst_rank][w.dst_page, w.dst_offset : w.dst_offset + w.length] += 1
    for d in range(dst.tp_size):
        want = rank_pages(logical, dst, d)
        for sp, dp in pairs:
            assert (coverage[d][dp] == 1).all()  # every destination byte written exactly once
            assert (dst_pools[d][dp] == want[sp]).all()  # and with the right bytes
    per_dst = Counter(w.dst_rank for w in plan.writes)
    assert tuple(per_dst.get(d, 0) for d in range(dst.tp_size)) == plan.expected
    pairs_of = Counter((w.dst_page, w.src_rank, w.dst_rank) for w in plan.writes)
    if src.layout is KVLayout.HND or src.kind is AttentionKind.MLA:
        assert set(pairs_of.values()) == {1}  # one write per (page, source shard, destination shard)
    else:
        assert set(pairs_of.values()) == {src.page_size}  # NHD: one write per token


def test_replicas_spread_across_sources() -> None:
    common: dict[str, Any] = {
        "kind": AttentionKind.GQA,
        "num_layers": 1,
        "page_size": 4,
        "layout": KVLayout.HND,
        "dtype": "float32",
    }
    src = KVLayoutSpec(tp_size=4, kv_heads=2, head_dim=8, **common)  # each head on 2 ranks
    dst = KVLayoutSpec(tp_size=2, kv_heads=2, head_dim=8, **common)
    sources = {w.src_rank for seed in range(4) for w in plan_writes(src, dst, [(0, 0)], seed).writes}
    assert sources == {0, 1, 2, 3}
    mla: dict[str, Any] = {
        "kind": AttentionKind.MLA,
        "num_layers": 1,
        "page_size": 4,
        "layout": KVLayout.HND,
        "dtype": "float32",
    }
    msrc, mdst = KVLayoutSpec(tp_size=2, latent_dim=8, **mla), KVLayoutSpec(tp_size=4, latent_dim=8, **mla)
    assert {w.src_rank for w in plan_writes(msrc, mdst, [(0, 0)], 0).writes} == {0, 1}


def test_write_counts_hnd_vs_nhd() -> None:
    common: dict[str, Any] = {
        "kind": AttentionKind.GQA,
        "num_layers": 1,
        "page_size": 16,
        "dtype": "float32",
        "kv_heads": 4,
        "head_dim": 8,
    }
    pages = [(i, i) for i in range(10)]
    hnd = plan_writes(
        KVLayoutSpec(layout=KVLayout.HND, tp_size=2, **common), KVLayoutSpec(layout=KVLayout.HND, **common), pages
    )
    nhd = plan_writes(
        KVLayoutSpec(layout=KVLayout.NHD, tp_size=2, **common), KVLayoutSpec(layout=KVLayout.NHD, **common), pages
    )
    assert len(hnd.writes) == 10 * 2  # page x sender
    assert len(nhd.writes) == 10 * 2 * 16  # page x sender x token


def test_incompatible_layouts_are_refused() -> None:
    common: dict[str, Any] = {
        "kind": AttentionKind.GQA,
        "num_layers": 2,
        "layout": KVLayout.HND,
        "kv_heads": 4,
        "head_dim": 8,
    }
    a = KVLayoutSpec(page_size=16, dtype=DType.BFLOAT16, **common)
    b = KVLayoutSpec(page_size=32, dtype=DType.FLOAT32, **common)
    with pytest.raises(IncompatibleLayoutError, match=r"page_size: 16 vs 32; dtype: bfloat16 vs float32"):
        plan_writes(a, b, [(0, 0)])

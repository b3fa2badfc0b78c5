"""Routing by cache: a node's KV-event log (any thread, resync by snapshot) and the router's index
of it; the router sends a prompt where its prefix is cached unless the load there outweighs it."""

from __future__ import annotations

from frontend.cache_index import CacheIndex
from frontend.config import GroupEndpoint
from frontend.groups import GroupPool
from serving.kv_events import BlockStored, KVEventBatch, KVEventLog, KVEventsQuery
from tests.helpers import prompt_of, tiny_engine
from torch_engine.engine import LLMEngine
from torch_engine.prefix_cache import block_hash, chain_keys, root_key
from torch_engine.sampling import SamplingParams


def serve(engine: LLMEngine, log: KVEventLog, prompt: list[int], seq: int) -> int:
    """Run one prompt and hand the engine's new events to the log (the serving loop's report)."""
    engine.generate([prompt], SamplingParams(max_tokens=2))
    got = engine.cache_events(seq)
    log.record(got)
    return got.seq


def test_the_router_index_follows_the_engine_and_estimates_hits(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"), num_pages=24)
    desc = engine.describe()
    log = KVEventLog(desc.cache_identity, desc.page_size)
    index = CacheIndex()
    system = prompt_of(40, 1)
    seq = serve(engine, log, system + prompt_of(3, 2), 0)
    first = log.since(index.query())
    assert first.snapshot is not None and index.resyncs == 0  # a new reader starts from a snapshot
    index.apply(first)
    assert index.cached_tokens(system + prompt_of(9, 3), None) == 40  # the router's keys are the engine's
    assert index.cached_tokens(system + prompt_of(9, 3), "salted") == 0
    seq = serve(engine, log, prompt_of(50, 4), seq)  # 24 pages: evicts most of the first prompt
    later = log.since(index.query())
    assert later.snapshot is None and later.events  # an up-to-date reader gets events only
    index.apply(later)
    assert index.blocks == set(log.since(KVEventsQuery()).snapshot or ())  # events == the snapshot
    rid = engine.add_request(system + prompt_of(9, 3), SamplingParams(max_tokens=1))
    engine.step()
    assert engine.request(rid).cached_tokens == index.cached_tokens(system + prompt_of(9, 3), None)


def test_a_reader_resyncs_after_a_gap_or_a_restart(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"))
    desc = engine.describe()
    log = KVEventLog(desc.cache_identity, desc.page_size, capacity=2)
    index = CacheIndex()
    index.apply(log.since(index.query()))
    seq = 0
    for i in range(3):  # more events than the log keeps
        seq = serve(engine, log, prompt_of(9 + 4 * i, 10 + i), seq)
    behind = log.since(index.query())
    assert behind.snapshot is not None  # the reader fell behind the bounded log
    index.apply(behind)
    restarted = KVEventLog(desc.cache_identity, desc.page_size)
    again = restarted.since(index.query())  # another instance: its (empty) cache replaces what we knew
    assert again.snapshot == [] and again.instance != index.instance
    index.apply(again)
    assert not index.blocks and index.resyncs == 3


def test_the_pick_weighs_cached_tokens_against_load() -> None:
    pool = GroupPool.of([GroupEndpoint(name=n, grpc_url="x") for n in ("a", "b")])
    for g in pool.groups:
        g.up = True
    identity, prompt = "model/float32/hnd", prompt_of(64, 5)
    keys = chain_keys(root_key(identity, None), prompt, 4, 0, 15)
    batch = KVEventBatch(
        ts=0.0, instance="i", identity=identity, block_size=4, seq=1,
        events=[BlockStored(block_hashes=[block_hash(k) for k in keys], parent_block_hash=None, token_ids=prompt[:60],
                            block_size=4)],
    )  # fmt: skip
    pool.groups[1].cache.apply(batch)
    assert pool.pick(set(), prompt) == (pool.groups[1], 60)  # b holds 60 of the 64 tokens
    with pool.track(pool.groups[1], 4, 50):  # b is busier by 54 tokens: still less work than 64 cold
        assert pool.pick(set(), prompt)[0] is pool.groups[1]  # type: ignore[index]
        with pool.track(pool.groups[1], 10, 10):  # now 74: a's cold prompt is less work
            assert pool.pick(set(), prompt) == (pool.groups[0], 0)

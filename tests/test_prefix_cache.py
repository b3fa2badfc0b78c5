"""The prefix cache: cache on == cache off token for token (greedy, fp32), cached pages hold the KV a
fresh computation gives, reference counts go back to the cached state, eviction and isolation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import prompt_of, speculating_engine, tiny_engine
from torch_engine.config import KVLayout, PrefixCacheConfig, SpecMethod, SpeculativeConfig
from torch_engine.connector import Accepted, Placement, Reserved
from torch_engine.engine import LLMEngine
from torch_engine.pages import PageAllocator
from torch_engine.prefix_cache import KVEventKind
from torch_engine.request import RequestOutput
from torch_engine.sampling import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=8)
Dirs = Callable[..., Path]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[RequestOutput]:
    """Each prompt to completion, together; the last output of each."""
    ids = [engine.add_request(p, params) for p in prompts]
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    for i in ids:
        engine.retire(i)
    return [last[i] for i in ids]


def conversation(engine: LLMEngine, system: list[int], turns: int, seed: int) -> list[RequestOutput]:
    """A chat: each turn resends the history (system prompt, earlier turns and answers) plus a new message."""
    history, outs = list(system), []
    for t in range(turns):
        history += prompt_of(5 + 3 * t, seed + t)
        (out,) = run(engine, [history])
        outs.append(out)
        history += out.output_ids
    return outs


def assert_settled(engine: LLMEngine) -> None:
    """Nothing held: every page is free or cached and unheld, nothing pinned."""
    s = engine.page_stats()
    assert (s.used, s.pinned, s.free) == (0, 0, s.total)


# -- the allocator's part ---------------------------------------------------------------------
def test_cached_pages_are_shared_revived_and_evicted_oldest_leaf_first() -> None:
    a = PageAllocator(6)
    evicted: list[int] = []
    a.on_evict = evicted.append
    chain = a.allocate(3)
    for p in chain:
        a.mark_cached(p)
    a.share(chain[:2])  # a second holder of the first two
    a.free(chain)
    assert (a.stats().used, a.stats().cached) == (2, 1)
    a.free(chain[:2])
    assert (a.stats().free, a.stats().cached) == (6, 3)
    assert a.revivals(chain) == 3
    a.share(chain[:1])  # a hit revives the root
    assert a.stats().cached == 2 and a.refs(chain[0]) == 1
    a.free(chain[:1])
    a.allocate(4)  # 3 free pages, then the oldest cached: the chain's leaf (freed tail first)
    assert evicted == [chain[2]]
    with pytest.raises(ValueError, match="neither held nor cached"):
        PageAllocator(2).share([1])


def test_a_pinned_cached_page_is_never_evicted() -> None:
    a = PageAllocator(2, max_cached=0)
    (p,) = a.allocate(1)
    a.mark_cached(p)
    a.pin([p])
    a.free([p])
    assert a.stats().used == 1 and not a.can_allocate(2)  # a transfer still reads it
    a.unpin([p])
    assert a.stats().cached == 0 and a.stats().free == 2  # max_cached 0: straight back to the free list


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "share", "pin", "unpin"]), st.integers(0, 5))))
def test_random_sharing_keeps_every_count(ops: list[tuple[str, int]]) -> None:
    a = PageAllocator(12, max_cached=5)
    alive: set[int] = set()  # cached pages not yet evicted
    a.on_evict = alive.discard
    held: list[list[int]] = []
    pinned: list[list[int]] = []
    for op, n in ops:
        if op == "alloc" and a.can_allocate(n):
            held.append(a.allocate(n))
        elif op == "free" and held:
            a.free(held.pop(n % len(held)))
        elif op == "cache" and held and held[n % len(held)]:
            p = held[n % len(held)][0]
            a.mark_cached(p)
            alive.add(p)
        elif op == "share" and alive:
            p = sorted(alive)[n % len(alive)]
            a.share([p])
            held.append([p])
        elif op == "pin" and held:
            a.pin(held[n % len(held)])
            pinned.append(held[n % len(held)])
        elif op == "unpin" and pinned:
            a.unpin(pinned.pop(n % len(pinned)))
        s = a.stats()
        holders: dict[int, int] = {}
        for g in held:
            for p in g:
                holders[p] = holders.get(p, 0) + 1
        assert all(a.refs(p) == k for p, k in holders.items())
        assert s.cached <= 5 and s.free + s.used == s.total
        assert all(not a.is_cached(p) or p in alive for p in range(12))
    for g in pinned:
        a.unpin(g)
    for g in held:
        a.free(g)
    assert a.stats().used == 0 and a.stats().cached == len(alive)


# -- the engine: cache on == cache off ------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])  # GQA and MLA
@pytest.mark.parametrize("layout", [KVLayout.HND, KVLayout.NHD])
def test_multi_turn_reuses_history_and_matches_cache_off(kind: str, layout: KVLayout, tiny_engine_dir: Dirs) -> None:
    system = prompt_of(37, 1)  # not page-aligned: the partial last page is computed again
    on = tiny_engine(tiny_engine_dir(kind), layout=layout, chunk=16, budget=32)
    off = tiny_engine(tiny_engine_dir(kind), layout=layout, chunk=16, budget=32, prefix_cache=False)
    got, want = conversation(on, system, 4, 10), conversation(off, system, 4, 10)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert all(o.cached_tokens == 0 for o in want)
    assert got[0].cached_tokens == 0
    for t in range(1, 4):  # each turn reuses every full page of the previous turn's tokens
        prev = got[t - 1].prompt_tokens + len(got[t - 1].output_ids) - 1  # the last answer token has no KV
        assert got[t].cached_tokens == prev // 4 * 4 > 0
    assert_settled(on)
    assert on.page_stats().cached > 0


def test_whole_prompt_cached_recomputes_the_last_token(tiny_engine_dir: Dirs) -> None:
    prompt = prompt_of(32, 2)  # 8 full pages of 4
    on = tiny_engine(tiny_engine_dir("llama"))
    first, again = run(on, [prompt])[0], run(on, [prompt])[0]
    assert again.output_ids == first.output_ids
    assert (first.cached_tokens, again.cached_tokens) == (0, 28)  # never the whole prompt: the last page runs
    assert_settled(on)


def test_cached_pages_hold_what_a_fresh_computation_writes(tiny_engine_dir: Dirs) -> None:
    """Byte-level: every page a hit reuses holds the KV the cache-off engine computes for those tokens."""
    system = prompt_of(40, 3)
    on = tiny_engine(tiny_engine_dir("llama"), chunk=8, budget=16)
    conversation(on, system, 3, 20)
    history = list(system) + prompt_of(9, 99)
    rid = on.add_request(history, SamplingParams(max_tokens=1))
    on.step()
    req = on.request(rid)
    hit = (req.cached_tokens or 0) // 4
    assert hit >= 10
    off = tiny_engine(tiny_engine_dir("llama"), prefix_cache=False)
    oid = off.add_request(history, SamplingParams(max_tokens=2))
    off.step()  # the whole prompt in one chunk; its pages stay with it until the second token
    ref_pages = off.request(oid).pages
    for mine, theirs in zip(on.kv_export().pools, off.kv_export().pools, strict=True):
        torch.testing.assert_close(mine[req.pages[:hit]], theirs[ref_pages[:hit]], atol=1e-5, rtol=1e-5)


def test_eviction_pressure_and_preemption_keep_tokens(tiny_engine_dir: Dirs) -> None:
    """A pool too small for the batch: requests are preempted, cached pages evicted and reused,
    and every token equals the cache-off run."""
    shared = prompt_of(24, 4)
    prompts = [shared + prompt_of(6 + i, 30 + i) for i in range(6)] + [prompt_of(20, 50 + i) for i in range(3)]
    params = SamplingParams(max_tokens=10)
    on = tiny_engine(tiny_engine_dir("llama"), num_pages=40, chunk=8, budget=24)
    off = tiny_engine(tiny_engine_dir("llama"), num_pages=40, chunk=8, budget=24, prefix_cache=False)
    for _ in range(2):  # the second round finds some of the first round's pages, evicts others
        assert [o.output_ids for o in run(on, prompts, params)] == [o.output_ids for o in run(off, prompts, params)]
    assert on.num_preemptions > 0
    assert_settled(on)


def test_a_bounded_cache_keeps_at_most_its_size(tiny_engine_dir: Dirs) -> None:
    on = tiny_engine(tiny_engine_dir("llama"), prefix_cache=5)
    run(on, [prompt_of(60, 7)])
    assert on.page_stats().cached == 5
    again = run(on, [prompt_of(60, 7)])[0]
    assert again.cached_tokens == 20  # leaves went first: the 5 kept are the chain's root pages


@pytest.mark.parametrize("method", [SpecMethod.NGRAM, SpecMethod.MTP])
def test_speculative_decoding_with_the_cache_matches_cache_off(
    method: SpecMethod, tiny_engine_dir: Dirs, mtp_engine_dir: Dirs
) -> None:
    """Rejected draft positions never enter the cache: with drafts on, a later request that reuses the
    first one's pages still gets the cache-off tokens."""
    spec = SpeculativeConfig(method=method, num_tokens=3, give_up_after=None)
    path = tiny_engine_dir("llama") if method is SpecMethod.NGRAM else mtp_engine_dir("llama")
    base = prompt_of(12, 8) * 3  # repetitive: the n-gram drafter proposes
    on = speculating_engine(path, spec)
    off_cache = speculating_engine(path, spec, prefix_cache=PrefixCacheConfig(enabled=False))
    params = SamplingParams(max_tokens=16)
    first = run(on, [base], params)[0]
    follow = base + first.output_ids + prompt_of(5, 9)
    second = run(on, [follow], params)[0]
    assert second.cached_tokens > len(base)
    want = run(off_cache, [base], params)[0], run(off_cache, [follow], params)[0]
    assert (first.output_ids, second.output_ids) == (want[0].output_ids, want[1].output_ids)
    assert on.spec_stats.proposed > 0 and on.spec_stats.accepted < on.spec_stats.proposed
    assert_settled(on)


def test_salts_isolate_and_a_bad_salt_is_refused(tiny_engine_dir: Dirs) -> None:
    on = tiny_engine(tiny_engine_dir("llama"))
    prompt = prompt_of(30, 11)
    run(on, [prompt], SamplingParams(max_tokens=2, cache_salt="alice"))
    assert run(on, [prompt], SamplingParams(max_tokens=2, cache_salt="bob"))[0].cached_tokens == 0
    assert run(on, [prompt], SamplingParams(max_tokens=2))[0].cached_tokens == 0
    assert run(on, [prompt], SamplingParams(max_tokens=2, cache_salt="alice"))[0].cached_tokens == 28
    for bad in ("", "x" * 257, 7):
        with pytest.raises(InvalidRequestError, match="cache_salt") as err:
            on.add_request(prompt, SamplingParams(cache_salt=bad))  # type: ignore[arg-type]
        assert err.value.param == "cache_salt"


def test_events_report_stored_and_removed_blocks_in_order(tiny_engine_dir: Dirs) -> None:
    on = tiny_engine(tiny_engine_dir("llama"), num_pages=13)
    run(on, [prompt_of(17, 12)], SamplingParams(max_tokens=1))
    events = on.cache_events(0).events
    assert [e.kind for e in events] == [KVEventKind.STORED] * len(events)
    stored = [h for e in events for h in e.block_hashes]
    assert len(stored) == 4 and events[0].parent_block_hash is None and events[0].block_size == 4
    assert [t for e in events for t in e.token_ids] == prompt_of(17, 12)[:16]
    seq = events[-1].seq
    run(on, [prompt_of(51, 13)], SamplingParams(max_tokens=1))  # needs the whole pool: evicts them
    later = on.cache_events(seq).events
    removed = [h for e in later if e.kind is KVEventKind.REMOVED for h in e.block_hashes]
    assert sorted(removed) == sorted(stored)
    assert sorted(removed) == sorted(stored)
    stats = on.cache_stats()
    assert stats.cached_pages == 12 and (stats.hits, stats.queries) == (0, 17 + 51)
    assert on.clear_prefix_cache() == 12 and on.cache_stats().cached_pages == 0
    last = on.cache_events(later[-1].seq)
    assert last.events[-1].kind is KVEventKind.ALL_CLEARED and last.snapshot is None


def test_a_decoder_hit_reserves_and_pins_only_the_pages_a_transfer_writes(tiny_engine_dir: Dirs) -> None:
    """Decode-first reuse at the port: the cached prefix is shared (``first_page``), only the rest is
    reserved and pinned — the shared pages' other holders stay preemptible — and a failed request
    gives every page back to its cached state."""
    eng = tiny_engine(tiny_engine_dir("llama"))
    prompt = prompt_of(41, 21)  # 10 full pages of [0, 40) cached after it ran
    run(eng, [prompt])
    follow = prompt + prompt_of(9, 22)  # KV of [0, 49): 13 pages, 10 of them cached
    adm = eng.admit_for_kv(follow, SamplingParams(max_tokens=2), "x", lambda load, n: Placement.REMOTE)
    assert isinstance(adm, Reserved) and adm.first_page == 10 and len(adm.pages) == 3
    assert eng.page_stats().pinned == 3 and eng.request("x").cached_tokens == 40
    full = eng.admit_for_kv(prompt, SamplingParams(max_tokens=2), "y", lambda load, n: Placement.REMOTE)
    assert isinstance(full, Accepted) and full.placement is Placement.LOCAL  # a full hit moves no KV
    eng.kv_failed("x", "the prefill group went away")
    eng.unpin_pages(adm.pages)  # the connector's hold: no write can land any more
    while eng.has_unfinished():
        eng.step()
    eng.retire("x")
    eng.retire("y")
    assert_settled(eng)

"""Decode-first prefix reuse across the split (in-process prefill groups, the real messenger on the
in-memory transport): the decoder matches its own cache first and asks the prefill node only for the
pages it lacks; the prefill node computes only what its own cache lacks. Tokens equal the colocated
cache-off engine's; KV bytes follow the uncached pages; nothing is left held."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from kv_messenger.prefill_side import PrefillOutcome
from planner.placement import PlacementSpec
from tests.helpers import prompt_of, tiny_engine
from tests.split_harness import GREEDY, Cluster, cluster, wait_for
from torch_engine.engine import LLMEngine
from torch_engine.request import RequestOutput
from torch_engine.sampling import SamplingParams

Dirs = Callable[..., Path]


def sent_bytes(c: Cluster) -> dict[str, int]:
    """Request id -> KV bytes its prefill node wrote (filled as transfers finish)."""
    sent: dict[str, int] = {}

    def done(outcome: PrefillOutcome, _seconds: float) -> None:
        sent[outcome.request_id] = outcome.bytes_posted

    for p in c.prefills:
        p.on_done = done
    return sent


def chat(run: Callable[[str, list[int]], RequestOutput], system: list[int], turns: int) -> list[RequestOutput]:
    history, outs = list(system), []
    for t in range(turns):
        history += prompt_of(6, 100 + t)
        out = run(f"turn{t}", history)
        outs.append(out)
        history += out.output_ids
    return outs


def colocated(engine: LLMEngine) -> Callable[[str, list[int]], RequestOutput]:
    def run(_rid: str, prompt: list[int]) -> RequestOutput:
        rid = engine.add_request(prompt, GREEDY)
        last = None
        while engine.has_unfinished():
            for out in engine.step():
                last = out
        engine.retire(rid)
        assert last is not None
        return last

    return run


def test_multi_turn_moves_only_what_the_decoder_lacks(tiny_engine_dir: Dirs) -> None:
    system = prompt_of(301, 5)
    c = cluster(tiny_engine_dir, groups=1)
    sent = sent_bytes(c)
    try:
        got = chat(lambda rid, p: c.run({rid: p})[rid], system, 4)
        wait_for(c.settled, what="every page back")
        want = chat(colocated(tiny_engine(tiny_engine_dir("llama"), prefix_cache=False)), system, 4)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        page_bytes = sent["turn0"] // (-(-(got[0].prompt_tokens - 1) // 4))  # a cold turn moves every page
        for t in range(1, 4):
            o = got[t]
            cold = -(-(o.prompt_tokens - 1) // 4) * page_bytes
            assert o.cached_tokens >= got[t - 1].prompt_tokens - 4  # the decoder held the history
            assert 0 < sent[f"turn{t}"] <= 0.1 * cold, (t, sent[f"turn{t}"], cold)
            assert sent[f"turn{t}"] == (-(-(o.prompt_tokens - 1) // 4) - o.cached_tokens // 4) * page_bytes
    finally:
        c.stop()


def test_a_full_decoder_hit_moves_no_kv(tiny_engine_dir: Dirs) -> None:
    prompt = prompt_of(41, 6)  # [0, 40): 10 full pages, all cached after the first run
    c = cluster(tiny_engine_dir, groups=1)
    sent = sent_bytes(c)
    try:
        first = c.run({"a": prompt})["a"]
        second = c.run({"b": prompt})["b"]
        wait_for(c.settled, what="every page back")
        assert second.output_ids == first.output_ids
        assert (first.cached_tokens, second.cached_tokens) == (0, 40)
        assert "b" not in sent and sent["a"] > 0  # the second never reached a prefill node
    finally:
        c.stop()


def test_the_prefill_node_reuses_its_own_cache(tiny_engine_dir: Dirs) -> None:
    """A prompt the decoder has never seen but the prefill node has: it computes only the new part
    (its cache counts a hit), still sends every page, and the tokens are the same."""
    shared = prompt_of(64, 7)
    c = cluster(tiny_engine_dir, groups=1)
    sent = sent_bytes(c)
    try:
        c.run({"a": shared + prompt_of(5, 8)})
        wait_for(c.settled, what="every page back")
        assert c.decode.clear_prefix_cache() > 0  # the decoder forgets; the prefill node keeps its pages
        prefill = c.prefills[0].engine
        before = prefill.cache_stats().hits
        got = c.run({"b": shared + prompt_of(5, 9)})["b"]
        wait_for(c.settled, what="every page back")
        assert prefill.cache_stats().hits - before == 64
        assert got.cached_tokens == 0  # the decoder's own count: it had nothing
        assert sent["b"] == sent["a"]  # 68 tokens of KV either way: the decoder lacked all of it
        want = colocated(tiny_engine(tiny_engine_dir("llama"), prefix_cache=False))("b", shared + prompt_of(5, 9))
        assert got.output_ids == want.output_ids
    finally:
        c.stop()


def test_the_prefill_nodes_cache_keeps_salts_apart(tiny_engine_dir: Dirs) -> None:
    """``cache_salt`` reaches the prefill node (``PrefillRequest.cache_salt``): a prompt it holds under one
    salt is computed afresh under another (it was shared across salts there), and found again under its own."""
    prompt = prompt_of(64, 17)
    c = cluster(tiny_engine_dir, groups=1)
    prefill = c.prefills[0].engine
    try:
        hits = []
        for rid, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
            before = prefill.cache_stats().hits
            c.run({rid: prompt}, SamplingParams(max_tokens=4, cache_salt=salt))
            wait_for(c.settled, what="every page back")
            assert c.decode.clear_prefix_cache() > 0  # the decoder forgets: each prompt goes to the prefill node
            hits.append(prefill.cache_stats().hits - before)
        assert hits == [0, 0, 60]
        assert c.done["a"].output_ids == c.done["b"].output_ids == c.done["c"].output_ids
    finally:
        c.stop()


def test_cancels_at_every_phase_and_eviction_during_transfers_leave_nothing_held(tiny_engine_dir: Dirs) -> None:
    """Shared-prefix requests on a decoder too small to keep them all: cached pages are shared,
    evicted and reused while transfers pin others, and some requests are cancelled at once, after
    a step or two, or mid-decode. The ones that finish say what the cache-off colocated engine
    says; afterwards no page is held or pinned on either side and every record is gone."""
    shared = prompt_of(48, 11)
    prompts = {f"r{i}": shared + prompt_of(3 + i % 7, 200 + i) for i in range(24)}
    prompts |= {f"cold{i}": prompt_of(30, 300 + i) for i in range(6)}  # pressure: pages the cache must give up
    c = cluster(tiny_engine_dir, groups=2, decode_pages=48)
    rng = random.Random(3)
    cancelled: set[str] = set()
    try:
        for rid, p in prompts.items():
            c.submit(rid, p)
            if rng.random() < 0.3:
                time.sleep(rng.choice([0.0, 0.002, 0.02]))  # before admission, mid-transfer, or decoding
                c.loop.cancel(rid)
                cancelled.add(rid)
        wait_for(lambda: all(r in c.done or r in cancelled for r in prompts), timeout_s=60, what="requests")
        wait_for(c.settled, what="every page back")
        ref = colocated(tiny_engine(tiny_engine_dir("llama"), prefix_cache=False))
        finished = [r for r in prompts if r in c.done and r not in cancelled]
        assert len(finished) >= 12
        for rid in finished:
            assert c.done[rid].output_ids == ref(rid, prompts[rid]).output_ids, rid
        assert any(c.done[r].cached_tokens for r in finished)  # the shared prefix was reused
        assert c.decode.page_stats().pinned == 0 and c.decode.page_stats().used == 0
    finally:
        c.stop()


def test_n_choices_prefill_and_move_the_prompt_once(tiny_engine_dir: Dirs) -> None:
    """``n`` = 4 as the router runs it (``frontend/choices.py``): the first choice alone, the other three
    after its first token on the same decode group. The prompt's full pages are computed and moved once:
    each other choice moves and computes only the prompt's last partial page (its 2 tokens here), and the
    decoder counts the full pages as its own cache hit."""
    prompt = prompt_of(103, 11)  # KV of 102 tokens: 25 full 4-token pages + 2 tokens
    c = cluster(tiny_engine_dir, groups=1)
    sent = sent_bytes(c)
    prefill = c.prefills[0].engine
    try:
        lead = c.run({"a": prompt})["a"]
        queried = prefill.cache_stats().queries
        hits = prefill.cache_stats().hits
        rest = c.run({"b": prompt, "c": prompt, "d": prompt})
        wait_for(c.settled, what="every page back")
        page = sent["a"] // 26
        assert sent["a"] == 26 * page and lead.cached_tokens == 0
        assert [sent[r] for r in "bcd"] == [page] * 3  # the partial page, once per other choice
        assert [rest[r].cached_tokens for r in "bcd"] == [100] * 3  # the decoder's hit: every full page
        computed = (prefill.cache_stats().queries - queried) - (prefill.cache_stats().hits - hits)
        assert computed == 3 * 2  # the prefill node computed the partial page's 2 tokens per other choice
        assert all(rest[r].output_ids == lead.output_ids for r in "bcd")  # greedy: the same tokens
    finally:
        c.stop()


def test_n_choices_while_the_first_runs_move_and_prefill_nothing_more(tiny_engine_dir: Dirs) -> None:
    """``n`` = 4 as the router times it: the other choices start once the first has its first token, while it
    still runs. The decoder then holds every full page and, in the first choice's own page, the partial one:
    each other choice copies it and computes its last token only — no KV moved, no prefill node asked."""
    prompt = prompt_of(103, 11)
    c = cluster(tiny_engine_dir, groups=1)
    sent = sent_bytes(c)
    prefill = c.prefills[0].engine
    first: list[RequestOutput] = []

    def lead(out: RequestOutput) -> None:
        first.append(out)
        if out.finished:
            c.done["a"] = out

    try:
        c.loop.submit("a", prompt, SamplingParams(max_tokens=40), lead)
        wait_for(lambda: bool(first), what="the first choice's first token")
        queried = prefill.cache_stats().queries
        rest = c.run({"b": prompt, "c": prompt, "d": prompt}, SamplingParams(max_tokens=40))
        wait_for(lambda: "a" in c.done, what="the first choice")
        wait_for(c.settled, what="every page back")
        assert sent["a"] == 26 * (sent["a"] // 26) and not any(r in sent for r in "bcd")
        assert prefill.cache_stats().queries == queried  # the prefill node saw the prompt once
        assert all(rest[r].cached_tokens == 102 and rest[r].output_ids == c.done["a"].output_ids for r in "bcd")
    finally:
        c.stop()


def test_a_small_remainder_is_prefilled_on_the_decoder(tiny_engine_dir: Dirs) -> None:
    """``placement.local_max_tokens``: a prompt with that few tokens past the decoder's hit is prefilled on
    the decode node (remote mode otherwise): ``n`` = 4's other choices move nothing and reach no prefill
    node; a cold prompt still goes remote; the tokens are the same."""
    prompt = prompt_of(103, 11)
    c = cluster(tiny_engine_dir, groups=1, placement=PlacementSpec(local_max_tokens=4))
    sent = sent_bytes(c)
    prefill = c.prefills[0].engine
    try:
        lead = c.run({"a": prompt})["a"]
        queried = prefill.cache_stats().queries
        rest = c.run({"b": prompt, "c": prompt, "d": prompt})
        wait_for(c.settled, what="every page back")
        assert sent["a"] > 0 and not any(r in sent for r in "bcd")  # the lead went remote, the others stayed
        assert prefill.cache_stats().queries == queried
        assert all(rest[r].output_ids == lead.output_ids and rest[r].cached_tokens == 100 for r in "bcd")
    finally:
        c.stop()

"""Reliability of the request path, in process (DESIGN 5; ARCHITECTURE "Fencing"): no page is reused
while a write can land, refusals reach the decoder at once, prefill jobs expire, state is bounded.

A decode node (``DecodeLoop`` + ``KVFetcher``) and prefill nodes (``PrefillLoop``) run on their own
threads and talk over the in-memory transport; the prefill calls go through ``ScriptedCaller``,
which can deliver a request *and* report the call as timed out (the case where the decoder cannot
know whether the group took it).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from functools import partial

import pytest
import torch
from tritonclient.utils import InferenceServerException

from kv_messenger.decode_side import DecodeSide
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.protocol import Notification, NotifKind
from kv_messenger.transport import MemoryFabric
from serving.decode_loop import DecodeLoop
from serving.decode_path import KVFetcher
from serving.kv_links import DecodeLink, engine_layout, metadata_bytes
from serving.prefill_client import Delivery, PrefillGroup, delivery_of, refusal
from serving.prefill_loop import PrefillLoop
from serving.request_ids import RequestIds
from serving.tp_group import GroupChannel, GroupDecodeSide
from tests.helpers import prompt_of, start_split, tiny_engine
from tests.split_harness import GREEDY, Cluster, ScriptedCaller, cluster, wait_for
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason
from torch_engine.sampling import SamplingParams


def failures_of(link: DecodeLink, timeout_s: float = 5.0) -> list[tuple[str, str]]:
    """Poll ``link`` until some request failed; returns the failures."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        failed = link.poll().failed
        if failed:
            return failed
        time.sleep(0.002)
    raise AssertionError("no request failed")


def snapshot(engine: LLMEngine) -> list[torch.Tensor]:
    return [p.clone() for p in engine.kv_export().pools]


def changed_pages(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    pages: set[int] = set()
    for b, a in zip(before, after, strict=True):
        diff = (b != a).reshape(b.shape[0], -1).any(dim=1)
        pages |= {int(i) for i in torch.nonzero(diff).reshape(-1)}
    return pages


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "decoder-hit"])
def test_a_late_write_of_an_abandoned_epoch_lands_only_in_its_fenced_pages(tiny_engine_dir, warm: bool) -> None:
    """With ``warm``, the decoder holds the victim's first 40 tokens in its prefix cache: those shared
    pages are never reserved, fenced or written; the fence covers only the pages past the hit."""
    c = cluster(tiny_engine_dir)
    try:
        prompts = {f"other{i}": prompt_of(9 + 7 * i, 50 + i) for i in range(3)}
        shared = prompt_of(40, 8)
        victim = shared + prompt_of(30, 7) if warm else prompt_of(30, 7)
        if warm:
            c.run({"warmup": shared + prompt_of(5, 9)})
        plain = tiny_engine(tiny_engine_dir("llama"), prefix_cache=False).generate([victim, *prompts.values()], GREEDY)
        slow = c.transports[0]
        slow.faults.stall_next = 10**6  # group 0 takes the request and then hangs in its writes
        ScriptedCaller.mode[0] = "timeout"
        ScriptedCaller.before_reply[0] = lambda: wait_for(lambda: slow.faults.stalled >= 2, what="group 0 to post")
        out = c.run({"victim": victim})["victim"]
        assert out.error is None and out.output_ids == plain[0]  # failed over to group 1, fresh pages
        fenced = c.fetcher.link.fenced()
        assert len(fenced) == 1 and fenced[next(iter(fenced))], "the abandoned epoch's pages are still held"
        fenced_pages = set(next(iter(fenced.values())))
        assert len(fenced_pages) == -(-(len(victim) - 1) // 4) - (10 if warm else 0)  # past the decoder's hit
        assert out.cached_tokens == (40 if warm else 0)
        assert c.decode.page_stats().pinned == len(fenced_pages)
        assert c.fetcher.records()["fenced_pages"] == len(fenced_pages)
        others = c.run(prompts)  # other requests run meanwhile: they never get a fenced page
        assert [o.output_ids for o in others.values()] == plain[1:]
        before = snapshot(c.decode)
        assert slow.release_stalled() >= 2  # the abandoned group's writes land now, long after failover
        wait_for(c.settled, what="the fence to lift and every page to come back")
        assert c.fetcher.records()["fenced_pages"] == 0
        landed = changed_pages(before, snapshot(c.decode))
        assert landed and landed <= fenced_pages  # the late bytes landed, and only in the fenced pages
        assert c.dside.stale == 0  # its notifications were counted against the fence, not dropped as unknown
        again = c.run({"again": victim})["again"]  # the node keeps serving
        assert again.output_ids == plain[0]
    finally:
        c.stop()


def test_failover_without_free_pages_waits_for_the_fence_then_reuses_them(tiny_engine_dir) -> None:
    c = cluster(tiny_engine_dir, decode_pages=12)  # the request needs 8 pages: no room for a second set
    try:
        victim = prompt_of(30, 8)
        plain = tiny_engine(tiny_engine_dir("llama")).generate([victim], GREEDY)
        slow = c.transports[0]
        slow.faults.stall_next = 10**6
        ScriptedCaller.mode[0] = "timeout"
        ScriptedCaller.before_reply[0] = lambda: wait_for(lambda: slow.faults.stalled >= 1, what="group 0 to post")
        c.submit("victim", victim)
        wait_for(lambda: bool(c.fetcher.link.fenced()), what="the failover")
        time.sleep(0.3)
        assert "victim" not in c.done  # its only pages are fenced: nothing may be sent to group 1 yet
        assert ScriptedCaller.servers[1].engine.page_stats().used == 0
        slow.release_stalled()  # group 0's writes complete; it closes the aborted epoch: the fence lifts
        wait_for(lambda: "victim" in c.done, what="the retry on group 1")
        assert c.done["victim"].output_ids == plain[0]
        wait_for(c.settled, what="every page back")
    finally:
        c.stop()


def test_an_unreachable_group_is_retried_at_once_on_the_same_pages(tiny_engine_dir) -> None:
    c = cluster(tiny_engine_dir)
    try:
        ScriptedCaller.mode[0] = "down"
        victim = prompt_of(21, 3)
        out = c.run({"v": victim})["v"]
        assert out.output_ids == tiny_engine(tiny_engine_dir("llama")).generate([victim], GREEDY)[0]
        assert c.fetcher.link.fenced() == {}  # never delivered: nothing to fence
        wait_for(c.settled, what="every page back")
    finally:
        c.stop()


def test_a_prompt_larger_than_every_prefill_pool_fails_fast_with_the_reason(tiny_engine_dir) -> None:
    fabric = MemoryFabric()
    kind = tiny_engine_dir("llama")
    decode = tiny_engine(kind)
    dside = DecodeSide(fabric.agent("d0"), engine_layout(decode.kv_export()), decode.kv_export().pools)
    small = PrefillLoop.standalone(tiny_engine(kind, num_pages=4), fabric.agent("p0"))  # 16 tokens at most
    small.handshake([dside.endpoint()])
    dside.connect([small.side.endpoint()])
    ScriptedCaller.servers, ScriptedCaller.mode = {0: small}, {}
    fetcher = KVFetcher(
        decode,
        GroupDecodeSide(dside, GroupChannel(decode), ["d0"]),
        [PrefillGroup(0, "-", ["p0"])],
        30,
        5,
        None,
        ScriptedCaller,
    )
    c = Cluster(decode, dside, fetcher, DecodeLoop(decode, kv=fetcher), [small], [])
    try:
        t0 = time.monotonic()
        out = c.run({"big": prompt_of(40, 1)})["big"]
        assert time.monotonic() - t0 < 5
        assert out.finish_reason is FinishReason.ERROR and "KV pages" in (out.error or "")
        ok = c.run({"small": prompt_of(10, 2)})["small"]  # the next request is fine
        assert ok.error is None and ok.output_ids == tiny_engine(kind).generate([prompt_of(10, 2)], GREEDY)[0]
        wait_for(c.settled, what="every page back")
    finally:
        c.stop()


# -- the messenger's fences and deadlines, one link at a time ----------------------------------


def linked(tiny_engine_dir, ttl_s: float = 30.0, grace_s: float = 30.0):
    fabric = MemoryFabric()
    kind = tiny_engine_dir("llama")
    prefill, decode = tiny_engine(kind, chunk=8, budget=16), tiny_engine(kind)
    pt, dt = fabric.agent("p0"), fabric.agent("d0")
    pside = PrefillSide(
        pt,
        engine_layout(prefill.kv_export()),
        prefill.kv_export().pools,
        prefill.kv_export().progress,
        metadata_bytes(prefill.kv_export()),
    )
    dside = DecodeSide(dt, engine_layout(decode.kv_export()), decode.kv_export().pools, grace_s=grace_s)
    pside.connect([dside.endpoint()])
    dside.connect([pside.endpoint()])
    loop = PrefillLoop(prefill, GroupPrefillSideFor(pside, prefill))
    return fabric, prefill, decode, loop, DecodeLink(decode, dside, ["p0"], timeout_s=ttl_s), pt, dside


def GroupPrefillSideFor(side: PrefillSide, engine: LLMEngine):
    from serving.tp_group import GroupPrefillSide

    return GroupPrefillSide(side, GroupChannel(engine))


def test_a_refusal_after_the_call_reaches_the_decoder_at_once_with_its_reason(tiny_engine_dir) -> None:
    _, _, decode, loop, dlink, pt, _ = linked(tiny_engine_dir)
    try:
        pt.faults.stall_next = 10**6
        req = start_split(dlink, prompt_of(20, 1), GREEDY, "dup")
        loop.submit(req)
        wait_for(lambda: pt.faults.stalled >= 1, what="the first write")
        loop.submit(req)  # delivered twice (a retried call): the call is accepted, the engine refuses it
        t0 = time.monotonic()
        failed = failures_of(dlink)
        assert time.monotonic() - t0 < 1.0
        assert failed[0][0] == "dup" and "refused by the prefill group" in failed[0][1] and "in use" in failed[0][1]
        pt.release_stalled()
        wait_for(lambda: (dlink.poll(), dlink.live() == 0)[1], what="the pages to come back")
        assert decode.page_stats().pinned == 0 and loop.refused == 1
        wait_for(lambda: loop.live() == 0, what="the prefill node to let go")
    finally:
        loop.stop()


def test_an_abort_before_the_request_arrives_is_confirmed_and_the_late_request_refused(tiny_engine_dir) -> None:
    _, prefill, decode, loop, dlink, _, dside = linked(tiny_engine_dir)
    try:
        req = start_split(dlink, prompt_of(20, 1), GREEDY, "early")
        dlink.abort("early")  # the client went away before the prefill request was delivered
        wait_for(lambda: (dlink.poll(), dlink.live() == 0)[1], timeout_s=5, what="the prefill's confirmation")
        before = snapshot(decode)  # the pages are free again (not after a grace period: confirmed)
        loop.submit(req)  # the request arrives late
        wait_for(lambda: loop.refused == 1, what="the late request to be refused")
        time.sleep(0.1)
        assert changed_pages(before, snapshot(decode)) == set()  # nothing was written
        assert prefill.page_stats().used == 0 and loop.side.local.tombstones() == 1
        assert dside.live() == 0
    finally:
        loop.stop()


def test_a_vanished_decoder_costs_the_prefill_node_nothing_past_its_deadline(tiny_engine_dir) -> None:
    fabric, prefill, _, loop, dlink, pt, _ = linked(tiny_engine_dir, ttl_s=1.0)
    try:
        pt.faults.stall_next = 10**6  # the decoder stops answering: every write hangs
        loop.submit(start_split(dlink, prompt_of(30, 1), GREEDY, "orphan"))
        wait_for(lambda: pt.faults.stalled >= 1, what="the first write")
        assert prefill.page_stats().used > 0
        t0 = time.monotonic()
        wait_for(lambda: loop.live() == 0 and prefill.page_stats().used == 0, timeout_s=5, what="the deadline")
        assert time.monotonic() - t0 < 2.0 and loop.side.local.expired == 1 and prefill.page_stats().pinned == 0
        # a decoder whose agent is gone: the writes fail and the pages come back at once
        pt.faults.stall_next = 0
        fabric.agents.pop("d0")
        loop.submit(start_split(dlink, prompt_of(30, 2), GREEDY, "gone"))
        wait_for(lambda: loop.live() == 0 and prefill.page_stats().used == 0, timeout_s=2, what="failed writes")
    finally:
        loop.stop()


def test_a_failed_write_fails_the_request_at_once_and_the_next_is_fine(tiny_engine_dir) -> None:
    _, _, decode, loop, dlink, pt, _ = linked(tiny_engine_dir)
    try:
        pt.faults.fail_next = 1
        loop.submit(start_split(dlink, prompt_of(30, 1), GREEDY, "f"))
        t0 = time.monotonic()
        dlink_failed = failures_of(dlink)
        assert time.monotonic() - t0 < 2.0 and "prefill stopped after" in dlink_failed[0][1]  # not the 30 s timeout
        wait_for(lambda: (dlink.poll(), dlink.live() == 0)[1], what="the pages")
        prompt = prompt_of(14, 2)
        loop.submit(start_split(dlink, prompt, GREEDY, "next"))
        wait_for(lambda: "next" in dlink.poll().ready, what="the next request's KV")
        while decode.has_unfinished():
            decode.step()
        assert decode.request("next").output_ids == tiny_engine(tiny_engine_dir("llama")).generate([prompt], GREEDY)[0]
        assert pt.faults.failed == 1
    finally:
        loop.stop()


def test_refused_notifications_carry_any_reason() -> None:
    note = Notification(NotifKind.REFUSED, "a|b#1", 3, 0, "pool 100% full | try later")
    assert Notification.decode(note.encode()) == note
    kv = Notification(NotifKind.KV, "a|b", 1, 7)
    assert Notification.decode(kv.encode()) == kv


def test_request_ids_are_unique_on_a_node_and_across_nodes() -> None:
    a, b = RequestIds("decode0"), RequestIds("decode0")  # even a restarted node with the same name
    ids = [a.next("same") for _ in range(1000)] + [a.next() for _ in range(10)] + [b.next("same") for _ in range(10)]
    assert len(set(ids)) == len(ids) and ids[0].startswith("same#") and ids[1000].startswith("triton#")


def test_two_decode_nodes_sending_the_same_client_id_to_one_prefill_node(tiny_engine_dir) -> None:
    fabric = MemoryFabric()
    kind = tiny_engine_dir("llama")
    prefill = tiny_engine(kind, chunk=8, budget=16)
    loop = PrefillLoop.standalone(prefill, fabric.agent("p0"))
    links, engines = [], []
    for d in range(2):
        eng = tiny_engine(kind)
        side = DecodeSide(fabric.agent(f"d{d}"), engine_layout(eng.kv_export()), eng.kv_export().pools)
        loop.handshake([side.endpoint()])
        side.connect([loop.side.endpoint()])
        links.append(DecodeLink(eng, side, ["p0"]))
        engines.append(eng)
    try:
        prompt = prompt_of(25, 4)
        ids = [RequestIds(f"decode{d}").next("client-7") for d in range(2)]
        for link, rid in zip(links, ids, strict=True):
            loop.submit(start_split(link, prompt, GREEDY, rid))
        for link, eng, rid in zip(links, engines, ids, strict=True):
            wait_for(partial(lambda lk, r: r in lk.poll().ready, link, rid), what="both transfers")
            while eng.has_unfinished():
                eng.step()
        want = tiny_engine(kind).generate([prompt], GREEDY)[0]
        assert [e.request(r).output_ids for e, r in zip(engines, ids, strict=True)] == [want, want]
        assert loop.refused == 0
    finally:
        loop.stop()


@pytest.mark.parametrize("seed", [11])
def test_soak_random_cancels_and_failed_writes_leave_nothing_behind(tiny_engine_dir, seed: int) -> None:
    """400 short requests, 8 at a time, ~1/3 cancelled at random points, 5% of one group's writes
    failing, the other group's calls sometimes timing out: every request completes equal to
    colocated or ends with a clear error; afterwards every page and every record is gone."""
    c = cluster(tiny_engine_dir, grace_s=2.0)
    rng = random.Random(seed)
    try:
        c.transports[1].faults.fail_rate, c.transports[1].faults.seed = 0.05, seed
        prompts = {f"s{i}": prompt_of(rng.randrange(2, 40), 1000 + i) for i in range(400)}
        ref = tiny_engine(tiny_engine_dir("llama"))
        want = dict(zip(prompts, ref.generate(list(prompts.values()), SamplingParams(max_tokens=4)), strict=True))
        cancelled: set[str] = set()
        doomed: dict[str, float] = {}  # chosen at submission, so the mix does not depend on the machine's speed
        pending = list(prompts)
        live: list[str] = []
        deadline = time.monotonic() + 240
        while (pending or live) and time.monotonic() < deadline:
            live = [r for r in live if r not in c.done]
            while pending and len(live) < 8:
                rid = pending.pop()
                ScriptedCaller.mode[0] = "timeout" if rng.random() < 0.05 else "ok"
                if rng.random() < 1 / 3:
                    doomed[rid] = time.monotonic() + rng.random() * 0.05
                c.submit(rid, prompts[rid], SamplingParams(max_tokens=4))
                live.append(rid)
            now = time.monotonic()
            for victim in [r for r in live if r in doomed and r not in cancelled and doomed[r] <= now]:
                c.loop.cancel(victim)
                cancelled.add(victim)
            time.sleep(0.002)
        assert not pending and all(r in c.done for r in prompts), "a request hung"
        errors = {r: o.error for r, o in c.done.items() if o.finish_reason is FinishReason.ERROR}
        for rid, out in c.done.items():
            if out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP):
                assert out.output_ids == want[rid], rid
            elif out.finish_reason is FinishReason.ABORT:
                assert rid in cancelled
            else:
                assert out.finish_reason is FinishReason.ERROR and out.error, rid
        counts = Counter(o.finish_reason for o in c.done.values())
        print("soak outcomes:", dict(counts), "cancel calls:", len(cancelled))
        spared = [r for r in prompts if r not in doomed]
        finished = [r for r in spared if c.done[r].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)]
        assert len(finished) > len(spared) * 0.6, (len(finished), len(spared))  # only the faults fail the rest
        assert c.transports[1].faults.failed > 0 and errors  # the faults happened and were reported
        wait_for(c.settled, timeout_s=30, what="every page and record to be released")
        assert all(p.side.local.tombstones() <= len(cancelled) for p in c.prefills)
    finally:
        c.stop()


def test_writes_delayed_past_the_decoders_deadline_land_only_in_pages_still_held(tiny_engine_dir) -> None:
    _, _, decode, loop, dlink, pt, _ = linked(tiny_engine_dir, ttl_s=0.5)
    try:
        pt.faults.stall_next = 10**6  # the network holds every write
        req = start_split(dlink, prompt_of(30, 1), GREEDY, "late")
        loop.submit(req.model_copy(update={"ttl_s": 30.0}))  # the prefill's own deadline is far away
        wait_for(lambda: pt.faults.stalled >= 1, what="the first write")
        failed = failures_of(dlink)
        assert "timed out" in failed[0][1]
        held = decode.page_stats().pinned
        assert held > 0  # failed, but its pages are not reusable: a write may still land
        before = snapshot(decode)
        pt.release_stalled()  # the writes arrive after the deadline
        wait_for(lambda: (dlink.poll(), dlink.live() == 0)[1], what="the prefill's confirmation")
        assert decode.page_stats().used == 0 and decode.page_stats().pinned == 0
        landed = changed_pages(before, snapshot(decode))
        assert 0 < len(landed) <= held  # the late bytes landed in the held pages, nowhere else
        assert loop.live() == 0 and pt.faults.stalled >= 1
    finally:
        loop.stop()


def test_a_prefill_rank_writes_only_to_decode_ranks_it_shook_hands_with(tiny_engine_dir) -> None:
    _, _, decode, loop, dlink, pt, _ = linked(tiny_engine_dir)
    try:
        req = start_split(dlink, prompt_of(12, 1), GREEDY, "ok")
        side = loop.side.local
        with pytest.raises(ValueError, match="not connected"):
            side.submit(req.model_copy(update={"request_id": "x1", "decode_ranks": ["stranger"]}))
        with pytest.raises(ValueError, match="outside the decode pools"):
            side.submit(req.model_copy(update={"request_id": "x2", "dst_pages": [0, decode.describe().num_pages]}))
        assert side.jobs() == 0 and pt.faults.stalled == 0
    finally:
        loop.stop()


@pytest.mark.parametrize(
    ("status", "message", "want"),
    [
        ("StatusCode.INTERNAL", refusal("prompt has 9999 tokens; the pool holds 4096"), Delivery.REFUSED),
        ("StatusCode.INTERNAL", "Stub process 'prefill_0_0' is not healthy.", Delivery.UNKNOWN),  # died holding it
        ("StatusCode.INTERNAL", "Received RST_STREAM with error code 2", Delivery.UNKNOWN),  # reset after sending
        ("StatusCode.INVALID_ARGUMENT", "unexpected shape for input 'prefill_request'", Delivery.REFUSED),
        ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", Delivery.UNREACHED),
        ("StatusCode.UNAVAILABLE", "Socket closed", Delivery.UNKNOWN),
        ("StatusCode.NOT_FOUND", "Request for unknown model: 'prefill'", Delivery.UNREACHED),
        ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", Delivery.UNKNOWN),
        ("StatusCode.CANCELLED", "Locally cancelled", Delivery.UNKNOWN),
    ],
)
def test_grpc_failures_are_classified_by_whether_the_call_may_have_been_delivered(
    status: str, message: str, want: Delivery
) -> None:
    """Only a proof that the model never took the request lifts the need for a fence."""
    assert delivery_of(InferenceServerException(message, status=status)) is want

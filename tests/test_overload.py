"""Overload is shed, not absorbed, and a hung node is noticed: a decode node caps the requests
waiting for their first token and aborts those that wait too long (both errors ``OVERLOADED``),
its loop's watchdog turns a wedged pass into a process exit, and the router takes a group whose
loop is stuck (or that stopped answering probes) out of rotation and gives up its streams,
retrying the ones without a first token elsewhere."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend import groups
from frontend.config import GroupEndpoint, RouterSpec
from frontend.groups import GroupPool
from frontend.upstream import Overloaded, Piece
from serving.decode_loop import DecodeLoop
from serving.kv_events import KVEventBatch
from serving.loop import LoopStalled
from serving.names import OVERLOADED
from serving.node_config import RequestTimeouts
from tests.helpers import tiny_engine
from tests.router_harness import healthy, scripted_router
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import SamplingParams


class Outputs:
    """Every output a loop delivered, by request; ``done`` once each request's last arrived."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[RequestOutput]] = {}
        self.first_at: dict[str, float] = {}
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)

    def callback(self, rid: str) -> Any:
        def deliver(out: RequestOutput) -> None:
            with self.lock:
                self.by_request.setdefault(rid, []).append(out)
                self.first_at.setdefault(rid, time.monotonic())
                if out.finished:
                    self.finished.notify_all()

        return deliver

    def final(self, rid: str) -> RequestOutput | None:
        outs = self.by_request.get(rid, [])
        return outs[-1] if outs and outs[-1].finished else None

    def wait(self, rids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not all(self.final(r) is not None for r in rids):
                left = deadline - time.monotonic()
                assert left > 0, f"{sum(self.final(r) is None for r in rids)} requests never finished"
                self.finished.wait(left)


def test_a_node_at_3x_its_capacity_sheds_at_once_and_serves_the_rest(tiny_engine_dir) -> None:
    """4 running + 8 pending is the node's capacity; 36 requests arrive at once: the ones past the
    cap are refused at submission (never queued), every accepted one gets all its tokens, the
    pending count never passes the cap, and everything held comes back."""
    engine = tiny_engine(tiny_engine_dir("llama"), num_pages=128, max_num_seqs=4)
    loop = DecodeLoop(engine, max_pending=8)
    out = Outputs()
    try:
        rids = [f"r{i}" for i in range(36)]
        refused_at_once = []
        peak = 0
        for i, rid in enumerate(rids):
            loop.submit(rid, [1 + i % 7, 2, 3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True), out.callback(rid))
            peak = max(peak, loop.pending())
            got = out.final(rid)
            if got is not None:  # answered inside submit: shed
                refused_at_once.append(rid)
                assert got.finish_reason is FinishReason.ERROR and got.error is not None
                assert got.error.startswith(OVERLOADED) and "max_pending" in got.error
        out.wait(rids, 120)
        assert peak <= 8
        assert len(refused_at_once) >= 36 - 8 - 4 * 2  # whatever started meanwhile, most of the burst is shed
        served = [r for r in rids if r not in refused_at_once]
        assert len(served) >= 8
        for rid in served:
            final = out.final(rid)
            assert final is not None and final.error is None, final
            assert sum(len(o.new_token_ids) for o in out.by_request[rid]) == 12
        assert loop.pending() == 0 and loop.live() == 0
        # the node serves normally afterwards
        loop.submit("after", [9, 8, 7], SamplingParams(max_tokens=3), out.callback("after"))
        out.wait(["after"], 60)
        assert out.final("after") is not None and out.final("after").error is None  # type: ignore[union-attr]
    finally:
        loop.stop()
    assert engine.page_stats().used == 0


def test_a_request_without_a_first_token_in_time_is_aborted_alone(tiny_engine_dir, monkeypatch) -> None:
    """One sequence at a time: the request queued behind a long one (200 steps of >= 10 ms) passes
    ``first_token_s`` and ends as overloaded; the long one keeps every token and the pages all come back."""
    engine = tiny_engine(tiny_engine_dir("llama"), num_pages=128, max_num_seqs=1)
    step = engine.step

    def slow_step() -> list[RequestOutput]:
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    loop = DecodeLoop(engine, first_token_s=0.5)
    out = Outputs()
    try:
        loop.submit("long", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), out.callback("long"))
        deadline = time.monotonic() + 30
        while "long" not in out.first_at:  # running before the second one arrives
            assert time.monotonic() < deadline
            time.sleep(0.01)
        submitted = time.monotonic()
        loop.submit("queued", [4, 5, 6], SamplingParams(max_tokens=4), out.callback("queued"))
        out.wait(["queued"], 30)
        shed = out.final("queued")
        assert shed is not None and shed.error is not None and shed.error.startswith(OVERLOADED), shed
        assert "first_token_s" in shed.error and out.first_at["queued"] - submitted >= 0.5
        out.wait(["long"], 120)
        final = out.final("long")
        assert final is not None and final.error is None
        assert sum(len(o.new_token_ids) for o in out.by_request["long"]) == 200
        assert loop.pending() == 0 and loop.live() == 0
    finally:
        loop.stop()
    assert engine.page_stats().used == 0


def test_a_wedged_pass_is_fatal_and_a_slow_one_is_not(tiny_engine_dir, monkeypatch) -> None:
    """The watchdog fires only for a pass longer than ``stall_s``, with ``LoopStalled``; until then
    ``stalled_s`` (what the router's probe reads) grows."""
    engine = tiny_engine(tiny_engine_dir("llama"), num_pages=32)
    release = threading.Event()
    step = engine.step

    def wedged() -> list[RequestOutput]:
        release.wait(30)
        return step()

    fatal: list[BaseException] = []
    loop = DecodeLoop(engine, stall_s=1.0)
    loop.on_fatal = fatal.append
    out = Outputs()
    try:
        loop.submit("slow", [1, 2, 3], SamplingParams(max_tokens=2), out.callback("slow"))
        out.wait(["slow"], 30)
        time.sleep(1.5)  # idle: passes every few ms, never stalled
        assert not fatal and loop.stalled_s() < 0.5
        assert 0.0 < loop.longest_step_s() < 0.5  # the passes that stepped it (idle ones are not steps)
        monkeypatch.setattr(engine, "step", wedged)
        loop.submit("stuck", [1, 2, 3], SamplingParams(max_tokens=2), out.callback("stuck"))
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline, "the watchdog never fired"
            time.sleep(0.05)
        assert isinstance(fatal[0], LoopStalled) and loop.stalled_s() > 1.0
    finally:
        release.set()
        loop.stop()


def test_first_token_and_stall_deadlines_are_checked_against_the_others() -> None:
    with pytest.raises(ValueError, match="first_token_s"):
        RequestTimeouts(first_token_s=30, kv_transfer_s=60)
    with pytest.raises(ValueError, match="loop_stall_s"):
        RequestTimeouts(loop_stall_s=100, tp_collective_s=300)
    RequestTimeouts(first_token_s=61, loop_stall_s=301)


# -- the router --------------------------------------------------------------------------


class FakeClient:
    """What a probe asks of a group's gRPC client; the events call is faked in ``upstream``."""

    def __init__(self, name: str) -> None:
        self.name, self.ready, self.answers = name, True, True

    async def is_model_ready(self, name: str, headers: object = None) -> bool:
        if not self.answers:
            await asyncio.sleep(3600)
        return self.ready


def batch(stalled_s: float, longest_step_s: float = 0.0) -> KVEventBatch:
    return KVEventBatch(
        ts=0.0, instance="i", identity="x", block_size=16, seq=0, stalled_s=stalled_s, longest_step_s=longest_step_s
    )


def test_the_probe_takes_a_stalled_or_silent_group_out_and_brings_it_back(monkeypatch) -> None:
    stalled = {"a": 0.0, "b": 0.0}
    longest = {"a": 0.0, "b": 0.0}

    async def events(client: Any, query: Any, *_: object) -> KVEventBatch:
        return batch(stalled[client.name], longest[client.name])

    monkeypatch.setattr(groups.upstream, "events", events)
    pool = GroupPool.of([GroupEndpoint(name=n, grpc_url="x") for n in ("a", "b")], RouterSpec(stall_timeout_s=5))
    clients = {n: FakeClient(n) for n in ("a", "b")}
    for g in pool.groups:
        g.client = clients[g.name]

    async def go() -> None:
        await pool.probe(0.2)
        a, b = pool.groups
        assert a.up and b.up and not a.hung.is_set()
        stalled["a"] = 2.0  # slow, not hung: stays in rotation
        await pool.probe(0.2)
        assert a.up and not a.hung.is_set()
        stalled["a"] = 7.0
        await pool.probe(0.2)
        assert not a.up and a.hung.is_set() and "one pass for 7 s" in a.why_down
        assert pool.pick(set()) == (b, 0)
        stalled["a"] = 0.0  # the loop moved again
        await pool.probe(0.2)
        assert a.up and not a.hung.is_set()
        longest["a"], stalled["a"] = 3.0, 11.0  # its steps take up to 3 s (a big model on CPU): 11 s is slow
        await pool.probe(0.2)
        assert a.up and not a.hung.is_set()
        stalled["a"] = 12.0  # STALL_STEPS (4) of its longest steps: hung
        await pool.probe(0.2)
        assert not a.up and a.hung.is_set() and "longest step 3.0 s" in a.why_down
        stalled["a"] = 0.0
        await pool.probe(0.2)
        assert a.up
        clients["b"].answers = False  # the stub stopped answering: out at once, hung once silent long enough
        await pool.probe(0.2)
        assert not b.up and not b.hung.is_set() and "no answer to a probe" in b.why_down
        b.answered_at -= 10
        await pool.probe(0.2)
        assert b.hung.is_set() and "silent for" in b.why_down
        clients["b"].ready = False  # answering again, but its model is not ready: down, no longer hung
        clients["b"].answers = True
        await pool.probe(0.2)
        assert not b.up

    asyncio.run(go())


def router_run(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, scripts: dict[str, Any], body: dict[str, Any],
    during: Any = None,
) -> tuple[int, str, dict[str, Any], dict[str, str | None]]:  # fmt: skip
    router, pool = scripted_router(smollm2_dir, scripts, monkeypatch)

    async def go() -> tuple[int, str, dict[str, str | None]]:
        async with TestClient(TestServer(router.app())) as client:
            call = asyncio.ensure_future(client.post("/v1/completions", json={"model": "smollm2"} | body))
            if during is not None:
                await during(pool)
            r = await asyncio.wait_for(call, 30)
            return r.status, await r.text(), {"Retry-After": r.headers.get("Retry-After")}

    status, text, headers = asyncio.run(go())
    return status, text, {g.name: g for g in pool.groups}, headers


hang_cancelled: list[str] = []


async def hangs(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    """A group whose loop is wedged: the call is accepted and nothing ever comes back."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        hang_cancelled.append(name)
        raise
    yield Piece((), 0, 0, "")  # pragma: no cover


async def one_then_hangs(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    yield Piece((ids[-1],), 0, 1, "")
    await asyncio.sleep(3600)


async def sheds(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    raise Overloaded(f"{OVERLOADED}256 requests are waiting for their first token here (max_pending)")
    yield  # pragma: no cover


async def found_hung(pool: GroupPool) -> None:
    await asyncio.sleep(0.3)  # the request is waiting on group a
    a = pool.groups[0]
    assert a.in_flight == 1
    pool._alive(a, stalled_s=1e6)  # what a probe does when the loop reports a stuck pass


def test_a_request_waiting_on_a_hung_group_is_retried_elsewhere(smollm2_dir, monkeypatch) -> None:
    hang_cancelled.clear()
    status, text, gs, _ = router_run(
        smollm2_dir, monkeypatch, {"a": hangs, "b": healthy}, {"prompt": "x y", "max_tokens": 3}, found_hung
    )
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == 3
    assert hang_cancelled == ["a"]  # the call on the hung group was cancelled (the node aborts the request)
    assert not gs["a"].up and gs["a"].in_flight == gs["b"].in_flight == 0


def test_a_stream_from_a_group_found_hung_mid_way_ends_with_an_error(smollm2_dir, monkeypatch) -> None:
    status, text, _, _ = router_run(
        smollm2_dir, monkeypatch, {"a": one_then_hangs, "b": healthy},
        {"prompt": "x", "max_tokens": 3, "stream": True}, found_hung,
    )  # fmt: skip
    assert status == 200
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and "hung" in json.loads(events[-2])["error"]["message"]


def test_a_shed_request_tries_another_group_and_else_is_a_503_with_retry_after(smollm2_dir, monkeypatch) -> None:
    status, text, gs, _ = router_run(smollm2_dir, monkeypatch, {"a": sheds, "b": healthy}, {"prompt": "x"})
    assert status == 200, text
    assert gs["a"].up  # shedding is not a failure: the group stays in rotation
    status, text, gs, headers = router_run(smollm2_dir, monkeypatch, {"a": sheds, "b": sheds}, {"prompt": "x"})
    assert status == 503 and headers["Retry-After"] == "1"
    error = json.loads(text)["error"]
    assert error["type"] == "server_error" and "max_pending" in error["message"]
    assert gs["a"].up and gs["b"].up

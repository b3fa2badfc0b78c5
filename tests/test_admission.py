"""The router sheds overload: a bounded number served at once, a bounded FIFO queue with a deadline,
a per-client limit; the rest get 429 / 503 with Retry-After at once, and no slot is lost."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend import generation
from frontend.admission import Admission
from frontend.config import GroupEndpoint, RouterConfig, RouterSpec
from frontend.generation import ApiError
from frontend.server import Router
from frontend.upstream import Piece
from tests.router_harness import ScriptedPool
from torch_engine.sampling import SamplingParams


def test_slots_queue_fifo_and_are_handed_over() -> None:
    async def go() -> None:
        gate = Admission(max_in_flight=2, max_queued=2, queue_timeout_s=5.0)
        order: list[str] = []
        release = asyncio.Event()

        async def user(name: str) -> None:
            async with gate.slot(name):
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(user(n)) for n in "abcd"]
        await asyncio.sleep(0.05)
        assert order == ["a", "b"] and gate.in_flight == 2 and gate.queued == 2
        with pytest.raises(ApiError) as full:
            async with gate.slot("e"):
                pass
        assert full.value.status == 429 and full.value.retry_after is not None
        release.set()
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c", "d"]  # first come, first served
        assert gate.in_flight == 0 and gate.queued == 0 and gate.clients() == 0

    asyncio.run(go())


def test_a_standing_queue_serves_its_newest_waiter_first() -> None:
    """FIFO while the queue drains quickly; once the oldest waiter has waited half the timeout, a
    freed slot goes to the newest (adaptive LIFO), and the old ones still get their 503 on time."""

    async def go() -> None:
        gate = Admission(max_in_flight=1, max_queued=4, queue_timeout_s=1.0)
        order: list[str] = []
        release = {n: asyncio.Event() for n in "habcd"}

        async def user(name: str) -> None:
            try:
                async with gate.slot(name):
                    order.append(name)
                    await release[name].wait()
            except ApiError as exc:
                order.append(f"{name}:{exc.status}")

        tasks = [asyncio.create_task(user("h"))]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(user(n)) for n in "ab"]
        await asyncio.sleep(0.05)
        release["h"].set()  # the queue is young: first come, first served
        await asyncio.sleep(0.05)
        assert order == ["h", "a"]
        await asyncio.sleep(0.5)  # b has waited more than half the timeout: the queue stands
        tasks += [asyncio.create_task(user(n)) for n in "cd"]
        await asyncio.sleep(0.05)
        release["a"].set()
        await asyncio.sleep(0.05)
        assert order == ["h", "a", "d"]  # the newest
        await asyncio.sleep(0.5)  # b's second (of 1 s) runs out; c is still within its own
        assert order == ["h", "a", "d", "b:503"]
        release["d"].set()
        release["c"].set()
        await asyncio.gather(*tasks)
        assert order == ["h", "a", "d", "b:503", "c"]
        assert gate.in_flight == 0 and gate.queued == 0 and gate.clients() == 0

    asyncio.run(go())


def test_a_wait_that_runs_out_is_a_503_and_a_cancelled_waiter_gives_its_place_back() -> None:
    async def go() -> None:
        gate = Admission(max_in_flight=1, max_queued=4, queue_timeout_s=0.1, max_per_client=2)
        hold = asyncio.Event()

        async def holder() -> None:
            async with gate.slot("x"):
                await hold.wait()

        first = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as late:
            async with gate.slot("y"):
                pass
        assert late.value.status == 503 and late.value.code == "overloaded"
        waiter = asyncio.create_task(holder())  # x's second: queued
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as mine:
            async with gate.slot("x"):  # x's third: over its own limit
                pass
        assert mine.value.status == 429 and "2 requests in flight" in mine.value.message
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        hold.set()
        await first
        assert gate.in_flight == 0 and gate.queued == 0 and gate.clients() == 0

    asyncio.run(go())


def test_the_router_answers_429_with_retry_after_and_serves_the_rest(smollm2_dir: Path, monkeypatch) -> None:
    """One slot, one queue place: of three concurrent requests one is served, one waits and is served,
    one gets OpenAI's 429 with Retry-After at once."""

    async def slow(ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
        await asyncio.sleep(0.3)
        yield Piece((ids[-1],), 0, 1, "length")

    monkeypatch.setattr(generation.upstream, "stream", lambda c, ids, s, rid, *_: slow(ids, s))
    spec = RouterSpec(port=1, max_in_flight=1, max_queued=1, queue_timeout_s=5.0)
    cfg = RouterConfig(spec=spec, model_name="smollm2", engine_dir=smollm2_dir,
                       groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")])  # fmt: skip
    router = Router(cfg, ScriptedPool.of(cfg.groups))

    async def go() -> list[tuple[int, str, str | None]]:
        async with TestClient(TestServer(router.app())) as client:

            async def one(delay: float) -> tuple[int, str, str | None]:
                await asyncio.sleep(delay)
                r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "x", "max_tokens": 1})
                return r.status, await r.text(), r.headers.get("Retry-After")

            return list(await asyncio.gather(one(0), one(0.05), one(0.1)))

    results = asyncio.run(go())
    assert sorted(status for status, _, _ in results) == [200, 200, 429]
    _, text, retry = next(r for r in results if r[0] == 429)
    assert json.loads(text)["error"]["code"] == "rate_limit_exceeded" and retry == "1"
    assert router.admission.in_flight == 0 and router.admission.clients() == 0

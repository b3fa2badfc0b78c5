"""The engine port as its users see it: ``LLMEngine`` implements both Protocols, and the decode
request path (``KVFetcher`` -> ``DecodeLink`` -> messenger) runs against a small fake engine through
them alone: one engine call admits a request, a refusal is data that names its reason, and requests
that find no room wait in arrival order until pages come back."""

from __future__ import annotations

import queue
import time
from typing import ClassVar

import pytest

from kv_messenger.decode_side import DecodeSide
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.protocol import PrefillRequest
from kv_messenger.transport.memory import MemoryFabric
from serving.decode_path import KVFetcher
from serving.kv_links import engine_layout, metadata_bytes
from serving.prefill_client import PrefillGroup, Reply
from serving.tp_group import GroupChannel, GroupDecodeSide
from tests.fake_engine import FakeEngine
from torch_engine.connector import ConnectorPort, FollowerPort
from torch_engine.engine import LLMEngine
from torch_engine.sampling import InvalidRequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=4)


class Recorder:
    """A prefill caller that records what it would send (and delivers nothing)."""

    sent: ClassVar[list[PrefillRequest]] = []

    def __init__(self, group: PrefillGroup, timeout_s: float, replies: queue.Queue[Reply]) -> None:
        pass

    def call(self, req: PrefillRequest) -> None:
        Recorder.sent.append(req)

    def close(self) -> None:
        pass


def fetcher_over(fake: FakeEngine, head_of_line_s: float = 5.0) -> KVFetcher:
    fabric = MemoryFabric()
    kv = fake.kv_export()
    dside = DecodeSide(fabric.agent("d0"), engine_layout(kv), kv.pools, grace_s=0.05)
    source = FakeEngine().kv_export()
    pside = PrefillSide(
        fabric.agent("p0"), engine_layout(source), source.pools, source.progress, metadata_bytes(source)
    )
    pside.connect([dside.endpoint()])
    dside.connect([pside.endpoint()])
    Recorder.sent = []
    side = GroupDecodeSide(dside, GroupChannel(fake), ["d0"])
    groups = [PrefillGroup(0, "unused:0", ["p0"])]
    return KVFetcher(fake, side, groups, 30.0, 5.0, caller=Recorder, head_of_line_s=head_of_line_s)


def test_llm_engine_implements_both_ports() -> None:
    for port in (ConnectorPort, FollowerPort):
        members = [m for m in vars(port) if not m.startswith("_")]
        missing = [m for m in members if not hasattr(LLMEngine, m)]
        assert members and not missing, f"{port.__name__}: {missing}"


def test_one_engine_call_admits_a_request_and_the_prefill_request_names_its_pinned_pages() -> None:
    fake = FakeEngine()
    fetcher = fetcher_over(fake)
    fetcher.admit("a", list(range(10)), PARAMS)
    assert dict(fake.calls) == {"admit_for_kv": 1}
    (req,) = Recorder.sent
    assert req.request_id == "a" and req.dst_pages == fake.requests["a"].pages and len(req.dst_pages) == 3
    assert fake.allocator.stats().pinned == 3


def test_a_refused_prompt_raises_the_engines_reason_and_takes_nothing() -> None:
    fake = FakeEngine()
    fetcher = fetcher_over(fake)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        fetcher.admit("bad", [1, 2, 999], PARAMS)
    assert fake.allocator.stats().used == 0 and not Recorder.sent and not fetcher.busy()


def test_requests_without_room_wait_in_arrival_order_and_start_when_pages_come_back() -> None:
    fake = FakeEngine(num_pages=16, page_size=4)
    fetcher = fetcher_over(fake, head_of_line_s=0.0)  # strict arrival order
    fetcher.admit("a", list(range(41)), PARAMS)  # 10 pages
    fetcher.admit("b", list(range(41)), PARAMS)  # 10 more: no room
    fetcher.admit("c", list(range(5)), PARAMS)  # 1 page would fit, but it does not jump the queue
    assert [r.request_id for r in Recorder.sent] == ["a"]
    assert fetcher.records()["queued"] == 2 and fake.calls["admit_for_kv"] == 3
    assert fetcher.cancel("a")
    deadline = time.monotonic() + 5
    while len(Recorder.sent) < 3 and time.monotonic() < deadline:
        assert fetcher.tick() == []
        time.sleep(0.01)
    assert [r.request_id for r in Recorder.sent] == ["a", "b", "c"]  # a's pages came back after its fence
    assert fake.allocator.stats().used == 11


def test_a_big_prompt_waiting_for_pages_lets_small_ones_pass_for_a_while_then_goes_first() -> None:
    """No head-of-line blocking, no starvation: a prompt too big for the free pages is passed by later
    ones that fit until it has waited ``head_of_line_s``; from then on the ones behind it wait for it."""
    fake = FakeEngine(num_pages=16, page_size=4)
    fetcher = fetcher_over(fake, head_of_line_s=0.3)
    fetcher.admit("a", list(range(41)), PARAMS)  # 10 pages
    fetcher.admit("big", list(range(41)), PARAMS)  # 10 more: no room
    fetcher.admit("small", list(range(5)), PARAMS)  # 1 page: fits
    assert fetcher.tick() == []
    assert [r.request_id for r in Recorder.sent] == ["a", "small"] and fetcher.records()["queued"] == 1
    time.sleep(0.35)  # big has waited head_of_line_s
    fetcher.admit("late", list(range(5)), PARAMS)
    assert fetcher.tick() == [] and [r.request_id for r in Recorder.sent] == ["a", "small"]  # late waits for big
    assert fetcher.cancel("a")
    deadline = time.monotonic() + 5
    while len(Recorder.sent) < 4 and time.monotonic() < deadline:
        assert fetcher.tick() == []
        time.sleep(0.01)
    assert [r.request_id for r in Recorder.sent] == ["a", "small", "big", "late"]


def _typed(e: LLMEngine, f: FakeEngine) -> tuple[ConnectorPort, FollowerPort, ConnectorPort, FollowerPort]:
    """Checked by mypy, never called: both engines implement both ports."""
    return e, e, f, f

"""Cluster config validation, the rank map, the router, and the decode request path's failover."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import ClassVar

import pytest

from kv_messenger.decode_side import DecodeSide
from kv_messenger.protocol import PrefillRequest
from kv_messenger.transport import MemoryFabric
from orchestrator.cluster import ClusterConfig, ConfigError
from serving.bootstrap import PrefillGroup
from serving.decode_loop import DecodeLoop
from serving.decode_path import KVFetcher, Reply
from serving.kv_links import engine_layout, metadata_bytes
from serving.prefill_client import Delivery
from serving.prefill_loop import PrefillLoop
from serving.router import NoPrefillGroup, Router
from serving.tp_group import GroupChannel, GroupDecodeSide
from tests.helpers import prompt_of, tiny_engine
from torch_engine.config import Role
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ({"mode": "colocated", "prefill": {"count": 1}}, "mode 'colocated' has no prefill groups"),
        ({"prefill": {"count": 0}}, "needs prefill.count >= 1"),
        ({"decode": {"count": 0}}, "decode.count must be >= 1"),
        ({"decode": {"tp": 0}}, "decode.tp"),
        ({"decode": {"count": 2, "cores": [0]}}, "decode.cores lists 1 cores for 2 ranks"),
        ({"ports": {"http": 9000, "grpc": 9000}}, "ports must differ"),
        ({"transport": {"backend": "TCP"}}, "transport.backend"),
        ({"prefil": {"count": 1}}, "prefil: Extra inputs are not permitted"),
        ({"mode": "mixed"}, "mode: Input should be 'disaggregated' or 'colocated'"),
        ({"scheduler": {"max_prefill_chunk": 1024, "max_num_batched_tokens": 512}}, "max_prefill_chunk"),
        ({"timeouts": {"fence_grace_s": 10}}, "fence_grace_s (10.0 s) must be at least timeouts.kv_transfer_s"),
        ({"prefix_cache": {"max_cached_pages": -1}}, "prefix_cache.max_cached_pages"),
    ],
)
def test_bad_cluster_configs_name_the_problem(raw: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        ClusterConfig.parse(raw)


def test_the_fence_outlasts_the_prefill_job_by_default() -> None:
    cfg = ClusterConfig.parse({"timeouts": {"kv_transfer_s": 120}})
    assert cfg.timeouts.fence_grace == 125.0  # the job may write for kv_transfer_s after it arrived
    assert ClusterConfig.parse({"timeouts": {"fence_grace_s": 70}}).timeouts.fence_grace == 70.0


def test_cluster_config_files(tmp_path: Path) -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        ClusterConfig.load(path)  # every example in the repo is valid
    with pytest.raises(ConfigError, match="does not exist"):
        ClusterConfig.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: [1, 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ClusterConfig.load(bad)


def test_rank_map_decode_groups_first_then_prefill() -> None:
    cfg = ClusterConfig.parse({"prefill": {"count": 2, "tp": 2}, "decode": {"count": 1, "tp": 3}})
    slots = cfg.rank_map()
    assert [(s.role, s.group, s.tp_rank) for s in slots] == [
        (Role.DECODE, 0, 0), (Role.DECODE, 0, 1), (Role.DECODE, 0, 2),
        (Role.PREFILL, 0, 0), (Role.PREFILL, 0, 1), (Role.PREFILL, 1, 0), (Role.PREFILL, 1, 1),
    ]  # fmt: skip
    assert [s.mpi_rank for s in slots] == list(range(7))
    assert slots[4].describe() == "prefill group 0 TP rank 1 (MPI rank 4)"
    colo = ClusterConfig.parse({"mode": "colocated", "prefill": {"count": 0}, "decode": {"count": 2}}).rank_map()
    assert [(s.role, s.group) for s in colo] == [(Role.COLOCATED, 0), (Role.COLOCATED, 1)]


def test_router_least_outstanding_prefill_tokens() -> None:
    now = [0.0]
    r = Router(3, cooldown_s=5, clock=lambda: now[0])
    assert r.pick() == 0  # ties: lowest index
    r.sent(0, "a", 100)
    assert r.pick() == 1
    r.sent(1, "b", 10)
    r.reported(2, 500)  # other decoders keep group 2 busy
    assert r.pick() == 1
    r.sent(1, "c", 200)  # group 1 now holds 210 of ours
    assert r.pick() == 0
    r.finished(0, "a")
    assert r.load(0) == 0 and r.pick() == 0
    r.reported(0, 300)  # group 0 reports 300 in all; none of it is ours
    assert r.load(0) == 300 and r.pick() == 1
    r.failed(1, "b")
    r.failed(1, "c")
    assert r.pick() == 0  # group 1 sits out
    assert r.pick(exclude={0}) == 2
    with pytest.raises(NoPrefillGroup, match="tried: 0, 2"):
        r.pick(exclude={0, 2})
    now[0] = 6.0
    assert r.pick(exclude={0, 2}) == 1  # back after the cooldown


class FakeCaller:
    """Group 0 refuses every call (as a dead or overloaded group would); others reach their server."""

    servers: ClassVar[dict[int, PrefillLoop]] = {}
    calls: ClassVar[list[int]] = []

    def __init__(self, group: PrefillGroup, timeout_s: float, replies: queue.Queue[Reply]) -> None:
        self.group, self.replies = group, replies

    def call(self, req: PrefillRequest) -> None:
        FakeCaller.calls.append(self.group.group)
        server = FakeCaller.servers.get(self.group.group)
        if server is None:
            error, how = "failed to connect: connection refused", Delivery.UNREACHED
            self.replies.put(Reply(self.group.group, req.request_id, req.epoch, None, error, how))
        else:
            load = server.submit(req)
            self.replies.put(Reply(self.group.group, req.request_id, req.epoch, load, None))

    def close(self) -> None:
        pass


def run_loop(loop: DecodeLoop, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for i, p in enumerate(prompts):
        loop.submit(f"q{i}", p, params, lambda out: done.__setitem__(out.request_id, out) if out.finished else None)
    deadline = time.monotonic() + 60
    while len(done) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [done[f"q{i}"] for i in range(len(prompts))]


def test_a_refusing_prefill_group_is_skipped_and_requests_fail_cleanly_when_none_is_left(tiny_engine_dir) -> None:
    fabric = MemoryFabric()
    decode = tiny_engine(tiny_engine_dir("llama"))
    dside = DecodeSide(
        fabric.agent("d0"),
        engine_layout(decode.kv_export()),
        decode.kv_export().pools,
        metadata_bytes(decode.kv_export()),
        4,
    )
    prefill = tiny_engine(tiny_engine_dir("llama"), chunk=8, budget=16)
    server = PrefillLoop.standalone(prefill, fabric.agent("p1"))
    server.handshake([dside.endpoint()])
    dside.connect([server.side.endpoint()])
    gone = PrefillLoop.standalone(tiny_engine(tiny_engine_dir("llama")), fabric.agent("p0"))  # never reached
    dside.connect([gone.side.endpoint()])
    groups = [PrefillGroup(0, "unused:0", ["p0"]), PrefillGroup(1, "unused:1", ["p1"])]
    FakeCaller.servers, FakeCaller.calls = {1: server}, []
    side = GroupDecodeSide(dside, GroupChannel(decode), ["d0"])
    fetcher = KVFetcher(decode, side, groups, 30.0, 5.0, caller=FakeCaller)
    loop = DecodeLoop(decode, kv=fetcher)
    try:
        prompts = [prompt_of(n, n) for n in (6, 19, 33)]
        params = SamplingParams(max_tokens=7)
        outs = run_loop(loop, prompts, params)
        assert [o.error for o in outs] == [None] * 3
        assert [o.output_ids for o in outs] == tiny_engine(tiny_engine_dir("llama")).generate(prompts, params)
        assert FakeCaller.calls[0] == 0 and 1 in FakeCaller.calls  # tried group 0 first, then group 1
        FakeCaller.servers = {}  # now every group refuses
        fetcher.router = Router(2)  # forget the cooldowns
        failed = run_loop(loop, [prompt_of(12, 1)], params)[0]
        assert failed.finish_reason is FinishReason.ERROR
        assert "no prefill group could take it" in (failed.error or "")
        time.sleep(0.05)
        assert decode.page_stats().used == 0 and decode.page_stats().pinned == 0
        FakeCaller.servers, fetcher.router = {1: server}, Router(2)
        fetcher.groups = [PrefillGroup(0, "unused:0", ["nobody"]), groups[1]]  # senders never connected
        bad = run_loop(loop, [prompt_of(5, 2)], params)[0]
        assert bad.finish_reason is FinishReason.ERROR and "are not connected" in (bad.error or "")
        assert decode.page_stats().used == 0 and decode.page_stats().pinned == 0
        fetcher.groups = groups
        fetcher.router.failed(0, "-")
        again = run_loop(loop, prompts[:1], params)[0]  # the node keeps serving
        assert again.output_ids == outs[0].output_ids
    finally:
        loop.stop()
        server.stop()
        gone.stop()

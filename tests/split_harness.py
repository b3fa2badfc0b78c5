"""A decode node and prefill nodes in one process, for tests of the request path: a ``DecodeLoop`` +
``KVFetcher`` and ``PrefillLoop``s on their own threads, over the in-memory transport; the prefill
calls go through ``ScriptedCaller``, which can deliver a request *and* report the call as timed out
(the case where the decoder cannot know whether the group took it)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kv_messenger.decode_side import DecodeSide
from kv_messenger.protocol import PrefillRequest
from kv_messenger.transport import MemoryFabric
from kv_messenger.transport.memory import MemoryTransport
from planner.placement import PlacementSpec
from serving.decode_loop import DecodeLoop
from serving.decode_path import KVFetcher
from serving.kv_links import engine_layout, metadata_bytes
from serving.prefill_client import Delivery, PrefillGroup, Reply
from serving.prefill_loop import PrefillLoop
from serving.tp_group import GroupChannel, GroupDecodeSide
from serving.trace import Tracer
from tests.helpers import tiny_engine
from torch_engine.engine import LLMEngine
from torch_engine.request import RequestOutput
from torch_engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6)


def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class ScriptedCaller:
    """Group g's calls: ``mode[g]`` is 'ok' (deliver, answer the load), 'timeout' (deliver, then
    report a deadline: the decoder cannot tell it was taken), 'down' (never connected)."""

    servers: ClassVar[dict[int, PrefillLoop]] = {}
    mode: ClassVar[dict[int, str]] = {}
    before_reply: ClassVar[dict[int, Callable[[], None]]] = {}

    def __init__(self, group: PrefillGroup, timeout_s: float, replies: queue.Queue[Reply]) -> None:
        self.group, self.replies = group, replies

    def call(self, req: PrefillRequest) -> None:
        g = self.group.group
        mode = ScriptedCaller.mode.get(g, "ok")
        if mode == "down":
            self.replies.put(Reply(g, req.request_id, req.epoch, None, "failed to connect", Delivery.UNREACHED))
            return
        try:
            load = ScriptedCaller.servers[g].submit(req)
        except ValueError as exc:
            self.replies.put(Reply(g, req.request_id, req.epoch, None, str(exc), Delivery.REFUSED))
            return
        if mode == "timeout":
            hook = ScriptedCaller.before_reply.get(g)

            def late() -> None:
                if hook is not None:
                    hook()
                self.replies.put(Reply(g, req.request_id, req.epoch, None, "Deadline Exceeded", Delivery.UNKNOWN))

            threading.Thread(target=late, daemon=True).start()
        else:
            self.replies.put(Reply(g, req.request_id, req.epoch, load, None))

    def close(self) -> None:
        pass


@dataclass
class Cluster:
    decode: LLMEngine
    dside: DecodeSide
    fetcher: KVFetcher
    loop: DecodeLoop
    prefills: list[PrefillLoop]
    transports: list[MemoryTransport]
    done: dict[str, RequestOutput] = field(default_factory=dict)

    def submit(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        def cb(out: RequestOutput) -> None:
            if out.finished:
                self.done[rid] = out

        self.loop.submit(rid, prompt, params, cb)

    def run(self, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, RequestOutput]:
        for rid, p in prompts.items():
            self.submit(rid, p, params)
        wait_for(lambda: all(r in self.done for r in prompts), what="requests to finish")
        return {r: self.done[r] for r in prompts}

    def settled(self) -> bool:
        """Every page back, every per-request record gone, on every node."""
        d = self.decode.page_stats()
        return (
            d.used == 0
            and d.pinned == 0
            and self.loop.live() == 0
            and self.fetcher.link.live() == 0
            and self.dside.live() == 0
            and not self.fetcher.busy()
            and all(p.live() == 0 and p.engine.page_stats().used == 0 for p in self.prefills)
            and all(not p.side.outstanding() for p in self.prefills)
        )

    def stop(self) -> None:
        self.loop.stop()
        for p in self.prefills:
            p.stop()


def cluster(
    tiny_engine_dir, groups: int = 2, decode_pages: int = 256, grace_s: float = 30.0,
    placement: PlacementSpec | None = None, tracer: Tracer | None = None, engine_dir: Path | None = None,
) -> Cluster:  # fmt: skip
    """``engine_dir``: every node's engine (default: the tiny llama); the decoder loads its tokenizer."""
    fabric = MemoryFabric()
    kind = engine_dir or tiny_engine_dir("llama")
    decode = tiny_engine(kind, num_pages=decode_pages, tokenizer=engine_dir is not None)
    dside = DecodeSide(
        fabric.agent("d0"),
        engine_layout(decode.kv_export()),
        decode.kv_export().pools,
        metadata_bytes(decode.kv_export()),
        4,
        grace_s,
    )
    prefills, transports = [], []
    for g in range(groups):
        t = fabric.agent(f"p{g}")
        loop = PrefillLoop.standalone(tiny_engine(kind, chunk=8, budget=16), t)
        loop.handshake([dside.endpoint()])
        dside.connect([loop.side.endpoint()])
        prefills.append(loop)
        transports.append(t)
    ScriptedCaller.servers = dict(enumerate(prefills))
    ScriptedCaller.mode, ScriptedCaller.before_reply = {}, {}
    side = GroupDecodeSide(dside, GroupChannel(decode), ["d0"])
    pgroups = [PrefillGroup(g, f"unused:{g}", [f"p{g}"]) for g in range(groups)]
    fetcher = KVFetcher(decode, side, pgroups, 30.0, 5.0, tracer, caller=ScriptedCaller, placement=placement)
    return Cluster(decode, dside, fetcher, DecodeLoop(decode, kv=fetcher), prefills, transports)

"""``disagg bench transfer``'s decode side: a child process (spawned, NIXL/UCX between the two) that
owns a ``DecodeSide`` and answers typed messages from the parent, one reply each: set up pools and
an agent, connect, expect a request (or a raw NIXL write), report when it landed, exit."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from kv_messenger.config import NixlBackend
from kv_messenger.decode_side import DecodeSide
from kv_messenger.layout import KVLayoutSpec
from kv_messenger.protocol import RankEndpoint
from kv_messenger.transport.nixl import NixlTransport


# -- the decode child's typed messages (parent -> child; each answered by one reply) ---------------
@dataclass(frozen=True, slots=True)
class Setup:
    layout_json: str
    num_pages: int
    meta_bytes: int
    agent: str


@dataclass(frozen=True, slots=True)
class Connect:
    endpoint_json: str


@dataclass(frozen=True, slots=True)
class Expect:
    """Count a request's writes; answered by ``Ack`` at once and by ``Ready`` when it is over."""

    request_id: str
    sender: str
    num_pages: int
    meta: bool


@dataclass(frozen=True, slots=True)
class AwaitRaw:
    """Wait for the raw write's notification; answered by ``Ready``."""


@dataclass(frozen=True, slots=True)
class Close:
    pass


@dataclass(frozen=True, slots=True)
class Exit:
    pass


Command = Setup | Connect | Expect | AwaitRaw | Close | Exit


@dataclass(frozen=True, slots=True)
class Ack:
    endpoint_json: str = ""


@dataclass(frozen=True, slots=True)
class Ready:
    at: float  # time.monotonic() on the child (same clock: one machine)
    failed: tuple[tuple[str, str], ...] = ()


def _decode_process(conn: Connection, backend: NixlBackend) -> None:
    torch.set_num_threads(1)
    side: DecodeSide | None = None
    while True:
        cmd: Command = conn.recv()
        if isinstance(cmd, Exit):
            return
        if isinstance(cmd, Setup):
            spec = KVLayoutSpec.model_validate_json(cmd.layout_json)
            pools = [torch.zeros(cmd.num_pages, spec.page_bytes, dtype=torch.uint8) for _ in range(spec.num_layers)]
            meta_slots = 1 if cmd.meta_bytes else 0
            side = DecodeSide(NixlTransport(cmd.agent, backend), spec, pools, cmd.meta_bytes, meta_slots)
            conn.send(Ack(side.endpoint().model_dump_json()))
        elif isinstance(cmd, Close):
            if side is not None:
                side.transport.close()
            side = None
            conn.send(Ack())
        else:
            assert side is not None, f"{type(cmd).__name__} before Setup"
            _serve(conn, side, cmd)


def _serve(conn: Connection, side: DecodeSide, cmd: Connect | Expect | AwaitRaw) -> None:
    if isinstance(cmd, Connect):
        side.connect([RankEndpoint.model_validate_json(cmd.endpoint_json)])
        conn.send(Ack())
    elif isinstance(cmd, Expect):  # count until ready, then answer with the time it happened
        side.expect(cmd.request_id, 0, [cmd.sender], cmd.num_pages, 0, cmd.meta, 120)
        conn.send(Ack())
        while True:
            polled = side.poll()
            if polled.ready or polled.failed:
                conn.send(Ready(time.monotonic(), tuple(polled.failed)))
                return
            time.sleep(20e-6)
    else:
        while not [n for n in side.transport.notifications() if n[1] == b"raw"]:
            time.sleep(20e-6)
        conn.send(Ready(time.monotonic()))


class Decoder:
    def __init__(self, backend: NixlBackend) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_process, args=(child, backend), daemon=True)
        self.proc.start()

    def call(self, cmd: Command) -> Ack:
        self.conn.send(cmd)
        reply = self.conn.recv()
        assert isinstance(reply, Ack), f"expected Ack, got {reply!r}"
        return reply

    def ready(self) -> Ready:
        reply = self.conn.recv()
        assert isinstance(reply, Ready), f"expected Ready, got {reply!r}"
        return reply

    def stop(self) -> None:
        self.conn.send(Exit())
        self.proc.join(10)

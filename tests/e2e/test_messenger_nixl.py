"""The messenger over real NIXL/UCX between processes: every sharding case, byte for byte."""

from __future__ import annotations

import itertools
import multiprocessing as mp

import pytest

from kv_messenger.layout import AttentionKind
from kv_messenger.protocol import PrefillRequest
from tests.messenger_harness import Scenario
from tests.nixl_node import ask
from torch_engine.config import KVLayout


class Node:
    def __init__(self, side: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        from tests.nixl_node import serve

        self.proc = ctx.Process(target=serve, args=(child, side), daemon=True)
        self.proc.start()

    def call(self, cmd: str, arg: object = None, timeout: float = 120) -> object:
        return ask(self.conn, cmd, arg, timeout)


@pytest.fixture(scope="module")
def nodes():
    pre, dec = Node("prefill"), Node("decode")
    yield pre, dec
    for n in (pre, dec):
        n.call("exit")
        n.proc.join(10)


CASES = [
    Scenario(kind, layout, page, tp_p, tp_d, prompt_len=40, chunk=13)
    for kind, layout, page, tp_p, tp_d in itertools.product(
        list(AttentionKind), list(KVLayout), [1, 16], [1, 2, 4], [1, 2, 4]
    )
]


@pytest.mark.parametrize(
    "sc", CASES, ids=lambda s: f"{s.kind.value}-{s.layout.value}-p{s.page_size}-{s.prefill_tp}to{s.decode_tp}"
)
def test_nixl_pages_byte_identical(nodes, sc: Scenario, request) -> None:
    pre, dec = nodes
    tag = f"c{abs(hash(request.node.name)) % 10**8}"
    pre_eps = pre.call("setup", (sc, tag))
    dec_eps = dec.call("setup", (sc, tag))
    try:
        pre.call("connect", dec_eps)
        dec.call("connect", pre_eps)
        _, dst_pages = sc.pages()
        agents = [f"{tag}-p{r}" for r in range(sc.prefill_tp)]
        dec.call("expect", (agents, len(dst_pages)))
        req = PrefillRequest(
            request_id="req",
            epoch=0,
            prompt_ids=list(range(sc.prompt_len)),
            dst_pages=dst_pages,
            decode_ranks=[f"{tag}-d{r}" for r in range(sc.decode_tp)],
            seed=7,
            meta_slot=1,
        )
        dec.conn.send(("run", None))
        assert pre.call("run", req.model_dump_json()) == ",".join(["DONE"] * sc.prefill_tp)
        assert dec.conn.poll(60)
        assert dec.conn.recv() == "identical"
    finally:
        pre.call("close")
        dec.call("close")


def test_one_agent_used_from_two_threads_at_once() -> None:
    """The messenger thread writes and polls while the serving loop's thread sends refusals: the
    agents run in NIXL's strict thread-safe mode, every write lands whole, no notification is lost."""
    import threading
    import time

    import torch

    from kv_messenger.transport.base import TransferState
    from kv_messenger.transport.nixl import NixlTransport

    a, b = NixlTransport("threads-a"), NixlTransport("threads-b")
    assert a.sync_mode == b.sync_mode == "NIXL_THREAD_SYNC_STRICT"
    src = torch.arange(256, dtype=torch.uint8).repeat(256)
    dst = torch.zeros_like(src)
    a.register([src])
    b.register([dst])
    a.add_peer("threads-b", b.metadata())
    b.add_peer("threads-a", a.metadata())
    end = time.monotonic() + 2.0
    received: list[bytes] = []
    sent = [0]

    def serving_loop() -> None:
        while time.monotonic() < end:
            a.send_notif("threads-b", b"refused")
            sent[0] += 1
            received.extend(m for _, m in b.notifications())
            a.notifications()

    other = threading.Thread(target=serving_loop)
    other.start()
    writes = 0
    while time.monotonic() < end:
        handle = a.write("threads-b", [(src.data_ptr(), dst.data_ptr(), src.numel())], b"written")
        deadline = time.monotonic() + 10.0
        while (state := a.state(handle)) is TransferState.PENDING:  # over TCP the target's progress completes it
            assert time.monotonic() < deadline, "a write never completed"
            if not other.is_alive():
                received.extend(m for _, m in b.notifications())
        assert state is TransferState.DONE
        a.release(handle)
        writes += 1
    other.join()
    deadline = time.monotonic() + 10.0
    while received.count(b"refused") < sent[0] or received.count(b"written") < writes:
        assert time.monotonic() < deadline, "notifications lost"
        received.extend(m for _, m in b.notifications())
    assert writes > 10 and sent[0] > 10 and torch.equal(src, dst)
    a.close()
    b.close()

"""The messenger over the in-memory transport: byte-exact pages for every sharding case, faults, aborts."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

from kv_messenger.decode_side import DecodeSide
from kv_messenger.layout import AttentionKind, IncompatibleLayoutError
from kv_messenger.prefill_side import PrefillJobState, PrefillSide
from kv_messenger.protocol import Notification, NotifKind, PrefillRequest
from kv_messenger.transport import MemoryFabric
from tests.messenger_harness import LAYERS, FakeProgress, Scenario, drive, make_pools, spec
from torch_engine.config import KVLayout

META_BYTES = 64


def build(sc: Scenario, fabric: MemoryFabric, logical, timeout_s: float = 5.0, clock=None):
    prefills, progress = [], []
    for r in range(sc.prefill_tp):
        lay = spec(sc.kind, sc.layout, sc.page_size, sc.prefill_tp, r)
        pr = FakeProgress(LAYERS)
        prefills.append(
            PrefillSide(fabric.agent(f"p{r}"), lay, make_pools(lay, logical), pr, meta_slot_bytes=META_BYTES)
        )
        progress.append(pr)
    decodes = []
    for r in range(sc.decode_tp):
        lay = spec(sc.kind, sc.layout, sc.page_size, sc.decode_tp, r)
        kwargs = {"clock": clock} if clock else {}
        decodes.append(DecodeSide(fabric.agent(f"d{r}"), lay, make_pools(lay, None), META_BYTES, 4, **kwargs))
    for p in prefills:
        p.connect([d.endpoint() for d in decodes])
    for d in decodes:
        d.connect([p.endpoint() for p in prefills])
    return prefills, progress, decodes


CASES = [
    Scenario(kind, layout, page, tp_p, tp_d)
    for kind, layout, page, tp_p, tp_d in itertools.product(
        list(AttentionKind), list(KVLayout), [1, 16], [1, 2, 4], [1, 2, 4]
    )
]


@pytest.mark.parametrize(
    "sc", CASES, ids=lambda s: f"{s.kind.value}-{s.layout.value}-p{s.page_size}-{s.prefill_tp}to{s.decode_tp}"
)
def test_pages_and_metadata_arrive_byte_identical(sc: Scenario, layers_per_post: int = 1) -> None:
    fabric = MemoryFabric()
    logical = sc.logical()
    prefills, progress, decodes = build(sc, fabric, logical)
    for p in prefills:
        p.layers_per_post = layers_per_post
    _, dst_pages = sc.pages()
    agents = [f"p{r}" for r in range(sc.prefill_tp)]
    for d in decodes:
        d.expect("r1", 0, agents, len(dst_pages), seed=3, meta=True, timeout_s=5)
    req = PrefillRequest(
        request_id="r1",
        epoch=0,
        prompt_ids=list(range(sc.prompt_len)),
        dst_pages=dst_pages,
        decode_ranks=[f"d{r}" for r in range(sc.decode_tp)],
        seed=3,
        meta_slot=2,
    )
    meta = torch.arange(META_BYTES, dtype=torch.uint8)
    drive(prefills, progress, req, sc)
    prefills[0].set_metadata("r1", meta)  # known once the last chunk has run
    for p in prefills:
        p.poll_once()
        assert [o.state for o in p.completed()] == [PrefillJobState.DONE]
    for r, d in enumerate(decodes):
        polled = d.poll()
        assert polled.ready == ["r1"] and not polled.failed
        want, pages = sc.expected_dst(logical, r)
        for layer in range(LAYERS):
            assert np.array_equal(d.pools[layer][pages].numpy(), want[layer])
    assert torch.equal(decodes[0].meta_slot(2), meta)


@pytest.mark.parametrize("layers_per_post", [2, 3, 100])
@pytest.mark.parametrize("sc", [CASES[0], CASES[-1], CASES[len(CASES) // 2]], ids=["first", "last", "middle"])
def test_posting_several_layers_at_once_moves_the_same_bytes(sc: Scenario, layers_per_post: int) -> None:
    test_pages_and_metadata_arrive_byte_identical(sc, layers_per_post)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(sc: Scenario, rid: str = "r1", epoch: int = 0) -> PrefillRequest:
    _, dst_pages = sc.pages()
    return PrefillRequest(
        request_id=rid,
        epoch=epoch,
        prompt_ids=list(range(sc.prompt_len)),
        dst_pages=dst_pages,
        decode_ranks=[f"d{r}" for r in range(sc.decode_tp)],
        seed=1,
    )


def test_dropped_write_times_out_and_pages_are_reclaimable() -> None:
    sc = Scenario(AttentionKind.GQA, KVLayout.HND, 4, 2, 1)
    clock = Clock()
    prefills, progress, decodes = build(sc, MemoryFabric(), sc.logical(), clock=clock)
    n_pages = len(sc.pages()[1])
    decodes[0].expect("r1", 0, ["p0", "p1"], n_pages, seed=1, meta=False, timeout_s=2.0)
    prefills[1].transport.faults.drop_next = 1  # one transfer is lost on the way
    drive(prefills, progress, _request(sc), sc)
    for p in prefills:
        p.poll_once()
    polled = decodes[0].poll()
    assert not polled.ready and not polled.failed  # waiting: the senders say all was posted
    clock.now = 2.5
    polled = decodes[0].poll()
    assert polled.failed == [("r1", "request r1: KV transfer timed out: 59 of 60 writes")]
    assert polled.releasable == ["r1"]  # both senders finished: no write can still land
    assert prefills[1].transport.faults.dropped == 1


def test_cancel_mid_transfer_then_next_request_is_unaffected() -> None:
    sc = Scenario(AttentionKind.MLA, KVLayout.HND, 4, 2, 2, prompt_len=30)
    fabric = MemoryFabric()
    logical = sc.logical()
    prefills, progress, decodes = build(sc, fabric, logical)
    n_pages = len(sc.pages()[1])
    for d in decodes:
        d.expect("r1", 0, ["p0", "p1"], n_pages, seed=1, meta=False, timeout_s=5)
    src_pages, _ = sc.pages()
    for p in prefills:
        p.submit(_request(sc))
        p.schedule("r1", 1, 7, False, src_pages)
    progress[0].counts[0] = progress[1].counts[0] = 1  # layer 0 of the first chunk is out
    for p in prefills:
        p.poll_once()
    for d in decodes:  # the decoder cancels: the senders are told
        d.abort("r1")
        assert d.poll().releasable == []  # senders have not confirmed yet
    for p in prefills:
        p.poll_once()  # sees ABORTED, stops, confirms
        assert [o.state for o in p.completed()] == [PrefillJobState.ABORTED]
    for d in decodes:
        assert d.poll().releasable == ["r1"]
    # a later request over the same groups is unaffected
    for d in decodes:
        d.expect("r2", 0, ["p0", "p1"], n_pages, seed=1, meta=False, timeout_s=5)
    for pr in progress:
        pr.counts = [0] * LAYERS
    drive(prefills, progress, _request(sc, "r2"), sc)
    for p in prefills:
        p.poll_once()
    for r, d in enumerate(decodes):
        assert d.poll().ready == ["r2"]
        want, pages = sc.expected_dst(logical, r)
        for layer in range(LAYERS):
            assert np.array_equal(d.pools[layer][pages].numpy(), want[layer])


def test_late_write_of_an_old_epoch_is_rejected() -> None:
    sc = Scenario(AttentionKind.GQA, KVLayout.NHD, 4, 1, 1, prompt_len=20)
    prefills, progress, decodes = build(sc, MemoryFabric(), sc.logical())
    n_pages = len(sc.pages()[1])
    decodes[0].expect("r1", 1, ["p0"], n_pages, seed=1, meta=False, timeout_s=5)  # the decoder is at epoch 1
    drive(prefills, progress, _request(sc, epoch=0), sc)  # a sender still working on epoch 0
    prefills[0].poll_once()
    polled = decodes[0].poll()
    assert not polled.ready and decodes[0].stale > 0  # none of epoch 0's writes counted
    with pytest.raises(ValueError, match="epoch 0 is not newer than 0"):
        prefills[0].submit(_request(sc, epoch=0))
        prefills[0].submit(_request(sc, epoch=0))


def test_incompatible_handshake_moves_nothing() -> None:
    fabric = MemoryFabric()
    a = spec(AttentionKind.GQA, KVLayout.HND, 16, 1)
    b = spec(AttentionKind.GQA, KVLayout.NHD, 16, 1)
    pre = PrefillSide(fabric.agent("p0"), a, make_pools(a, None), FakeProgress(LAYERS))
    dec = DecodeSide(fabric.agent("d0"), b, make_pools(b, None))
    with pytest.raises(IncompatibleLayoutError, match="layout: hnd vs nhd"):
        pre.connect([dec.endpoint()])


def test_the_deadline_abort_takes_the_lock_the_engine_thread_drains_under() -> None:
    """Job state has one writer at a time: the messenger thread's deadline abort waits while the
    engine thread holds the side's lock (as ``schedule`` does when it moves STREAMING -> DRAINING),
    so a last chunk can never turn an expired job back into one that sends and ends with FIN."""
    sc = Scenario(AttentionKind.GQA, KVLayout.HND, 4, 1, 1)
    clock = Clock()
    fabric = MemoryFabric()
    lay = spec(sc.kind, sc.layout, sc.page_size, 1, 0)
    side = PrefillSide(fabric.agent("p0"), lay, make_pools(lay, sc.logical()), FakeProgress(LAYERS), clock=clock)
    decode = DecodeSide(fabric.agent("d0"), lay, make_pools(lay, None), META_BYTES, 4, clock=clock)
    side.connect([decode.endpoint()])
    decode.connect([side.endpoint()])
    req = _request(sc).model_copy(update={"ttl_s": 1.0})
    side.submit(req)
    clock.now = 5.0  # past the job's deadline
    job = side._jobs["r1"]  # white box: the messenger's own locking discipline
    poller = threading.Thread(target=side._advance, args=(job,))  # the messenger thread's pass over it
    with side._lock:  # the engine thread inside schedule()
        poller.start()
        poller.join(0.3)
        assert poller.is_alive()  # the abort waits for the lock
        assert job.state is PrefillJobState.STREAMING
    poller.join(5)
    assert not poller.is_alive()
    side.schedule("r1", 1, sc.prompt_len - 1, True, list(range(len(sc.pages()[1]))))  # the last chunk, late
    assert [o.state for o in side.completed()] == [PrefillJobState.ABORTED]


def test_a_bad_peer_costs_only_its_own_messages() -> None:
    """A malformed notification, and counts from an agent that is not one of the job's senders (or
    not one of its decode ranks), are dropped; the request completes from its real sender."""
    sc = Scenario(AttentionKind.GQA, KVLayout.HND, 4, 1, 1)
    fabric = MemoryFabric()
    prefills, progress, decodes = build(sc, fabric, sc.logical())
    rogue = fabric.agent("rogue")
    rogue.add_peer("d0", decodes[0].transport.metadata())
    rogue.add_peer("p0", prefills[0].transport.metadata())
    n_pages = len(sc.pages()[1])
    decodes[0].expect("r1", 0, ["p0"], n_pages, seed=1, meta=False, timeout_s=5)
    rogue.send_notif("d0", b"\xff not a notification")
    rogue.send_notif("d0", Notification(NotifKind.KV, "r1", 0, 10**6).encode())  # would overflow r1's count
    rogue.send_notif("d0", Notification(NotifKind.FIN, "r1", 0, 0).encode())
    polled = decodes[0].poll()
    assert not polled.ready and not polled.failed and decodes[0].malformed == 1
    prefills[0].submit(_request(sc))
    rogue.send_notif("p0", Notification(NotifKind.ABORTED, "r1", 0, 0).encode())  # not r1's decode rank
    rogue.send_notif("p0", b"|||")
    drive(prefills, progress, _request(sc), sc, submit=False)
    for p in prefills:
        p.poll_once()
    assert decodes[0].poll().ready == ["r1"]

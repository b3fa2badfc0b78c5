"""A TP decode group's leader merges its ranks' reports per epoch: a follower's report from before a
failover (about the abandoned epoch) never completes the new epoch, whose pages hold no KV yet."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from kv_messenger.decode_side import DecodeSide
from kv_messenger.layout import AttentionKind
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.transport import MemoryFabric
from serving.tp_group import GroupChannel, GroupDecodeSide
from serving.tp_messages import RankReport
from tests.messenger_harness import LAYERS, FakeProgress, make_pools, spec
from torch_engine.config import KVLayout


class FakeChannel:
    """The leader's end of the tick protocol, with the followers' reports scripted."""

    def __init__(self) -> None:
        self.tp = SimpleNamespace(size=2)
        self.sent: list[Any] = []
        self.queued: list[RankReport] = []

    def send(self, cmd: Any) -> None:
        self.sent.append(cmd)

    def sync(self, busy: bool) -> None:
        pass

    def reports(self) -> list[RankReport]:
        out, self.queued = self.queued, []
        return out


def test_a_stale_ready_of_an_abandoned_epoch_does_not_complete_the_new_one() -> None:
    fabric = MemoryFabric()
    lay = spec(AttentionKind.GQA, KVLayout.HND, 4, 1, 0)
    prefill = PrefillSide(fabric.agent("p0"), lay, make_pools(lay, None), FakeProgress(LAYERS))
    local = DecodeSide(fabric.agent("d0"), lay, make_pools(lay, None), 64, 4)
    local.connect([prefill.endpoint()])
    channel = FakeChannel()
    group = GroupDecodeSide(local, cast(GroupChannel, channel), ["d0", "d1"])
    group.expect("r", 0, ["p0"], 0, 1, False, 5.0)  # no pages to wait for: rank 0 is ready at its next poll
    assert group.abandon("r") == 0  # failover before anything landed
    group.expect("r", 1, ["p0"], 0, 1, False, 5.0)
    channel.queued = [RankReport(1, ready=["r"], epochs={"r": 0})]  # rank 1's report from before the abandon
    assert group.poll().ready == [] and group.stale_reports == 1
    channel.queued = [RankReport(1, ready=["r"], epochs={"r": 1})]  # rank 1's KV of the new epoch landed
    assert group.poll().ready == ["r"]

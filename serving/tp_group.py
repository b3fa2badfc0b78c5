"""The messenger across a tensor-parallel group: every rank moves its own shard's KV.

Only the group leader talks to the world (Triton, the router, the engine's scheduler). Each TP
rank has its own messenger side (its own NIXL agent and KV pools), so the leader forwards what
its side is told to the followers' sides, and collects what they report:

    leader ──GroupTick(commands, step inputs | None)──> followers      (one broadcast per tick)
    leader <──RankReport(completed / ready / failed / releasable)──── followers (one gather per tick)

A tick rides on every engine step (the engine's ``TickHook``, ``set_tick_hook``: the commands go out with the step,
so a follower's side learns which forward pass completes which pages *before* it runs), and
``sync`` sends an idle tick when no step runs but transfers are outstanding, or as a heartbeat.

``GroupPrefillSide`` / ``GroupDecodeSide`` implement the messenger's Protocols
(``kv_messenger/sides.py``) that ``PrefillLink`` / ``DecodeLink`` are typed against, and merge
the ranks: a prefill request is complete
when every rank finished it (its worst outcome wins); a decode request is ready when every rank
counted all its writes, failed when any rank failed (the others are then aborted), and its
pages are releasable only once every rank says no write can still land. With TP 1 they add
nothing: no collective runs. ``run_follower`` is a follower rank's whole life; the messages are
``serving/tp_messages.py``'s (a follower applies its own side's commands with an exhaustive
``match``; a command for the other side ends it with an error, never silently).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import assert_never

import torch

from kv_messenger.decode_side import DecodePoll, DecodeSide
from kv_messenger.prefill_side import PrefillJobState, PrefillOutcome, PrefillSide
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from serving.tp_messages import (
    DECODE_COMMANDS,
    PREFILL_COMMANDS,
    AbandonCmd,
    AbortCmd,
    Command,
    ConnectCmd,
    DecodeCommand,
    ExpectCmd,
    ForgetCmd,
    GroupTick,
    PrefillCommand,
    PrefillDoneCmd,
    RankReport,
    ScheduleCmd,
    SubmitCmd,
)
from torch_engine.connector import FollowerPort
from torch_engine.parallel import TPGroup
from torch_engine.steps import StepInputs


class GroupChannel:
    """Leader end of the tick protocol. With TP 1 every method is free."""

    def __init__(
        self, engine: FollowerPort, idle_tick_s: float = 0.001, heartbeat_s: float = 1.0, on_steps: bool = True
    ) -> None:
        self.tp: TPGroup = engine.tp_group()
        self.idle_tick_s = idle_tick_s
        self.heartbeat_s = heartbeat_s
        self._pending: list[Command] = []
        self._reports: list[RankReport] = []
        self._last = time.monotonic()
        if self.tp.size > 1 and on_steps:  # without a messenger (colocated) steps go out bare: no gather
            engine.set_tick_hook(self)

    def send(self, cmd: Command) -> None:
        if self.tp.size > 1:
            self._pending.append(cmd)

    def wrap(self, inputs: StepInputs) -> object:
        tick, self._pending = GroupTick(self._pending, inputs), []
        return tick

    def after(self) -> None:
        self._gather()

    def sync(self, busy: bool) -> None:
        """An idle tick if commands wait, if ``busy`` (transfers outstanding) and one is due, or as a heartbeat."""
        if self.tp.size == 1:
            return
        since = time.monotonic() - self._last
        if self._pending or (busy and since >= self.idle_tick_s) or since >= self.heartbeat_s:
            tick, self._pending = GroupTick(self._pending, None), []
            self.tp.broadcast_object(tick)
            self._gather()

    def reports(self) -> list[RankReport]:
        out, self._reports = self._reports, []
        return out

    def stop(self) -> None:
        if self.tp.size > 1:
            self.tp.broadcast_object(None)

    def _gather(self) -> None:
        got = self.tp.gather_object(RankReport(0))
        assert got is not None
        self._reports += [r for r in got[1:] if isinstance(r, RankReport)]
        self._last = time.monotonic()


class GroupPrefillSide:
    """The leader's prefill side for the whole group (``PrefillSide``'s interface)."""

    def __init__(self, local: PrefillSide, channel: GroupChannel) -> None:
        self.local = local
        self.channel = channel
        self.size = channel.tp.size
        self._partial: dict[str, tuple[set[int], PrefillOutcome]] = {}

    def endpoint(self) -> RankEndpoint:
        return self.local.endpoint()

    def connect(self, decode_ranks: Sequence[RankEndpoint]) -> None:
        self.local.connect(decode_ranks)
        self.channel.send(ConnectCmd(tuple(decode_ranks)))

    def start(self) -> None:
        self.local.start()

    def stop(self) -> None:
        self.local.stop()

    def submit(self, req: PrefillRequest) -> None:
        self.local.submit(req)
        self.channel.send(SubmitCmd(req))

    def schedule(self, request_id: str, forward: int, tokens_done: int, last: bool, src_pages: Sequence[int]) -> None:
        self.local.schedule(request_id, forward, tokens_done, last, src_pages)
        self.channel.send(ScheduleCmd(request_id, forward, tokens_done, last, tuple(src_pages)))

    def set_metadata(self, request_id: str, payload: torch.Tensor) -> None:
        self.local.set_metadata(request_id, payload)  # the leader alone writes the metadata

    def prefill_done(self, request_id: str) -> None:
        self.local.prefill_done(request_id)
        self.channel.send(PrefillDoneCmd(request_id))

    def abort(self, request_id: str) -> None:
        self.local.abort(request_id)
        self.channel.send(AbortCmd(request_id))

    def refuse(self, req: PrefillRequest, reason: str) -> None:
        """The leader refused ``req`` before any follower heard of it: it answers for the group."""
        self.local.refuse(req, reason)

    @property
    def failure(self) -> str | None:
        """Why the leader's side can send nothing more (None: it can)."""
        return self.local.failure

    def connected(self, agents: Sequence[str]) -> bool:
        return self.local.connected(agents)

    def was_aborted(self, request_id: str, epoch: int) -> bool:
        return self.local.was_aborted(request_id, epoch)

    def tombstones(self) -> int:
        return self.local.tombstones()

    def outstanding(self) -> bool:
        return bool(self._partial) or self.local.busy()

    def jobs(self) -> int:
        """Requests the group still tracks here (this rank's jobs, partial merges)."""
        return self.local.jobs() + len(self._partial)

    def sync(self) -> None:
        self.channel.sync(self.outstanding())

    def completed(self) -> list[PrefillOutcome]:
        """Requests finished on every rank: worst state, summed bytes."""
        if self.size == 1:
            return self.local.completed()
        arrivals = [(0, o) for o in self.local.completed()]
        arrivals += [(r.rank, o) for r in self.channel.reports() for o in r.completed]
        done = []
        for rank, o in arrivals:
            ranks, merged = self._partial.get(o.request_id, (set(), None))
            ranks.add(rank)
            if merged is None:
                merged = o
            else:
                worst = max(merged.state, o.state)
                error = merged.error if merged.state >= o.state else o.error
                merged = PrefillOutcome(o.request_id, worst, error, merged.bytes_posted + o.bytes_posted)
            if len(ranks) == self.size:
                self._partial.pop(o.request_id, None)
                done.append(merged)
            else:
                self._partial[o.request_id] = (ranks, merged)
        return done


@dataclass(slots=True)
class _Merge:
    epoch: int  # a rank's report about another epoch of the request is stale: never this one's
    ready: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)  # ranks where no write can land any more
    failed: bool = False
    aborted: bool = False


class GroupDecodeSide:
    """The leader's decode side for the whole group (``DecodeSide``'s interface)."""

    def __init__(self, local: DecodeSide, channel: GroupChannel, agents: Sequence[str]) -> None:
        self.local = local
        self.channel = channel
        self.size = channel.tp.size
        self.agents = list(agents)  # every rank's agent name, by TP rank
        self.meta_slots = local.meta_slots
        self._jobs: dict[str, _Merge] = {}
        self._fences: dict[tuple[str, int], set[int]] = {}  # abandoned epoch -> ranks where it lifted
        self.stale_reports = 0  # rank reports about an abandoned epoch, dropped

    def endpoint(self) -> RankEndpoint:
        return self.local.endpoint()

    def connect(self, prefill_ranks: Sequence[RankEndpoint]) -> None:
        self.local.connect(prefill_ranks)
        self.channel.send(ConnectCmd(tuple(prefill_ranks)))

    def meta_slot(self, slot: int) -> torch.Tensor:
        return self.local.meta_slot(slot)

    def expect(
        self,
        request_id: str,
        epoch: int,
        prefill_agents: Sequence[str],
        num_pages: int,
        seed: int,
        meta: bool,
        timeout_s: float,
    ) -> int:
        expected = self.local.expect(request_id, epoch, prefill_agents, num_pages, seed, meta, timeout_s)
        if self.size > 1:
            cmd = ExpectCmd(request_id, epoch, tuple(prefill_agents), num_pages, seed, timeout_s)
            self.channel.send(cmd)
            self._jobs[request_id] = _Merge(epoch)
        return expected

    def abort(self, request_id: str) -> None:
        self.local.abort(request_id)
        if request_id in self._jobs:
            self._jobs[request_id].aborted = True
            self.channel.send(AbortCmd(request_id))

    def forget(self, request_id: str) -> None:
        self.local.forget(request_id)
        if self._jobs.pop(request_id, None) is not None:
            self.channel.send(ForgetCmd(request_id))

    def abandon(self, request_id: str) -> int | None:
        """Failover on every rank: the current epoch becomes a fence, lifted once it lifted everywhere."""
        epoch = self.local.abandon(request_id)
        if self.size > 1 and self._jobs.pop(request_id, None) is not None:
            self.channel.send(AbandonCmd(request_id))
            if epoch is not None:
                self._fences[(request_id, epoch)] = set()
        return epoch

    def live(self) -> int:
        return self.local.live() + len(self._jobs) + len(self._fences)

    def poll(self) -> DecodePoll:
        if self.size == 1:
            return self.local.poll()
        self.channel.sync(bool(self._jobs))
        events = [(0, self.local.poll())]
        events += [
            (r.rank, DecodePoll(r.ready, r.failed, r.releasable, r.lifted, r.epochs)) for r in self.channel.reports()
        ]
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        releasable: list[str] = []
        lifted: list[tuple[str, int]] = []
        for rank, polled in events:
            for key in polled.lifted:
                ranks = self._fences.get(key)
                if ranks is not None:
                    ranks.add(rank)
                    if len(ranks) == self.size:
                        lifted.append(key)
                        del self._fences[key]
            for rid in polled.ready:
                job = self._current(rid, rank, polled)
                if job is not None:
                    job.ready.add(rank)
                    job.settled.add(rank)
            for rid, error in polled.failed:
                job = self._current(rid, rank, polled)
                if job is not None and not job.failed and not job.aborted:
                    job.failed = True
                    failed.append((rid, f"{error} (TP rank {rank})"))
                    self.abort(rid)  # the other ranks stop waiting; pages come back once all settle
            for rid in polled.releasable:
                job = self._current(rid, rank, polled)
                if job is not None:
                    job.settled.add(rank)
        for rid, job in list(self._jobs.items()):
            if not (job.failed or job.aborted) and len(job.ready) == self.size:
                ready.append(rid)
                del self._jobs[rid]
            elif (job.failed or job.aborted) and len(job.settled) == self.size:
                releasable.append(rid)
                del self._jobs[rid]
        return DecodePoll(ready, failed, releasable, lifted)

    def _current(self, rid: str, rank: int, polled: DecodePoll) -> _Merge | None:
        """The request's merge record if this report is about its current epoch (a follower's report
        from before an abandon can name the old epoch: its "ready" must not complete the new one)."""
        job = self._jobs.get(rid)
        if job is None or polled.epochs.get(rid, job.epoch) != job.epoch:
            self.stale_reports += job is not None
            return None
        return job


def run_follower(engine: FollowerPort, side: PrefillSide | DecodeSide | None) -> None:
    """A TP follower's life: apply the leader's commands to this rank's side, run each step, report."""
    tp = engine.tp_group()
    rank = tp.rank

    def on_tick(msg: object) -> None:
        if not isinstance(msg, GroupTick):
            raise RuntimeError(f"TP follower got {type(msg).__name__}")
        report = RankReport(rank)
        for cmd in msg.commands:
            _apply(side, cmd, report)
        if msg.inputs is not None:
            engine.execute_step(msg.inputs)
        if isinstance(side, PrefillSide):
            if side.failure is not None:  # this rank would send nothing more: end (the group restarts)
                raise RuntimeError(side.failure)
            report.completed += side.completed()
        elif isinstance(side, DecodeSide):
            polled = side.poll()
            report.ready, report.failed, report.releasable = polled.ready, polled.failed, polled.releasable
            report.lifted, report.epochs = polled.lifted, polled.epochs
        tp.gather_object(report)

    engine.run_follower(on_tick)


def _apply(side: PrefillSide | DecodeSide | None, cmd: Command, report: RankReport) -> None:
    """One leader command on this rank's side; a command for the other side is a broken group."""
    match side:
        case PrefillSide() if isinstance(cmd, PREFILL_COMMANDS):
            _apply_prefill(side, cmd, report)
        case DecodeSide() if isinstance(cmd, DECODE_COMMANDS):
            _apply_decode(side, cmd, report)
        case None if isinstance(cmd, ConnectCmd):
            pass  # a colocated TP group has no messenger
        case _:
            raise RuntimeError(f"TP follower with {type(side).__name__} got {type(cmd).__name__}")


def _apply_prefill(side: PrefillSide, cmd: PrefillCommand, report: RankReport) -> None:
    match cmd:
        case ConnectCmd():
            side.connect(cmd.endpoints)
        case SubmitCmd():
            try:
                side.submit(cmd.req)
            except ValueError as exc:  # the leader refused it too, or will hear of it here
                report.completed.append(PrefillOutcome(cmd.req.request_id, PrefillJobState.FAILED, str(exc)))
        case ScheduleCmd():
            side.schedule(cmd.request_id, cmd.forward, cmd.tokens_done, cmd.last, cmd.src_pages)
        case PrefillDoneCmd():
            side.prefill_done(cmd.request_id)
        case AbortCmd():
            side.abort(cmd.request_id)
        case _:
            assert_never(cmd)


def _apply_decode(side: DecodeSide, cmd: DecodeCommand, report: RankReport) -> None:
    match cmd:
        case ConnectCmd():
            side.connect(cmd.endpoints)
        case ExpectCmd():
            try:
                side.expect(
                    cmd.request_id, cmd.epoch, cmd.prefill_agents, cmd.num_pages, cmd.seed, False, cmd.timeout_s
                )
            except ValueError as exc:
                report.failed.append((cmd.request_id, str(exc)))
                report.releasable.append(cmd.request_id)
        case AbortCmd():
            side.abort(cmd.request_id)
        case ForgetCmd():
            side.forget(cmd.request_id)
        case AbandonCmd():
            side.abandon(cmd.request_id)
        case _:
            assert_never(cmd)

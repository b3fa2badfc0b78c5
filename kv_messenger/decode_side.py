"""Decode side of the KV messenger: one per decode TP rank.

Per request (``DecodeJobState``, ordered):

    WAITING ──all expected writes counted──> READY        (reported once by ``poll``)
       ├──deadline passed, or every sender closed short──> FAILED ─┐
       └──abort──────────────────────────────────────────> ABORTED ┴─every sender closed, or grace over─> released

Completion is by counting: ``expect`` computes from the shard plan how many writes this rank
receives (writes per layer x layers, + 1 for the metadata on the leader); KV notifications
carry how many writes each transfer held. FIN / ABORTED say how many writes a sender posted:
if every sender closed having posted fewer than expected, the request fails at once; if they
posted all but some never arrived (a lost write), the deadline fails it. A notification whose epoch is not the request's
current epoch is rejected (counted in ``stale``). A failed or aborted request's pages are
reported ``releasable`` only when no write can still land: every sender has sent FIN or
ABORTED for that epoch, or ``grace_s`` has passed since the failure. REFUSED (the prefill group
refused the request before any rank started it) fails the request at once with the group's reason
and closes every sender.

Failover (``abandon``): the current epoch is aborted (ABORTED to its senders) and kept as a
*fence* keyed by (request, epoch) while a new epoch of the same request may start; its writes
are still counted against the fence, which is reported in ``lifted`` once every sender closed
it or ``grace_s`` passed. Invariant: a page named in an epoch is reused only after that epoch
is over (ready, or releasable / lifted).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kv_messenger.layout import KVLayoutSpec, check_compatible
from kv_messenger.protocol import Notification, NotifKind, RankEndpoint
from kv_messenger.shard_plan import plan_writes
from kv_messenger.transport.base import Transport

log = logging.getLogger(__name__)


class DecodeJobState(enum.IntEnum):
    WAITING = 0
    READY = 1
    FAILED = 2
    ABORTED = 3


@dataclass(slots=True)
class _Expect:
    request_id: str
    epoch: int
    expected: int
    senders: set[str]
    deadline: float
    got: int = 0
    closed: set[str] = field(default_factory=set)
    posted: int = 0  # writes the closed senders say they posted to this rank
    state: DecodeJobState = DecodeJobState.WAITING
    error: str | None = None
    ended_at: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodePoll:
    ready: list[str]
    failed: list[tuple[str, str]]  # (request id, error)
    releasable: list[str]  # failed / aborted requests whose pages can be reused now
    lifted: list[tuple[str, int]] = field(default_factory=list)  # abandoned epochs no write can land in any more
    epochs: dict[str, int] = field(default_factory=dict)  # the epoch each ready / failed / releasable id was in


class DecodeSide:
    def __init__(
        self,
        transport: Transport,
        layout: KVLayoutSpec,
        pools: Sequence[torch.Tensor],
        meta_slot_bytes: int = 0,
        meta_slots: int = 0,
        grace_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.layout = layout
        self.pools = list(pools)
        self.grace_s = grace_s
        self.clock = clock
        transport.register(self.pools)
        self.meta = torch.zeros(max(meta_slots, 1), max(meta_slot_bytes, 1), dtype=torch.uint8)
        self.meta_slot_bytes, self.meta_slots = meta_slot_bytes, meta_slots
        if meta_slots:
            transport.register([self.meta])
        self._prefill: dict[str, RankEndpoint] = {}
        self._jobs: dict[str, _Expect] = {}
        self._fences: dict[tuple[str, int], _Expect] = {}  # abandoned epochs (failover) until no write can land
        self.stale = 0
        self.malformed = 0  # notifications that did not parse (dropped)

    def endpoint(self) -> RankEndpoint:
        return RankEndpoint.of(
            self.transport.name, self.transport.metadata(), self.layout, self.pools, self.meta, self.meta_slots
        )

    def connect(self, prefill_ranks: Sequence[RankEndpoint]) -> None:
        for ep in prefill_ranks:
            check_compatible(ep.layout, self.layout)
            self.transport.add_peer(ep.agent, ep.metadata)
            self._prefill[ep.agent] = ep

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
        """Start counting for a request whose KV (``num_pages`` pages) the given prefill ranks send."""
        try:
            src = self._prefill[prefill_agents[0]].layout.model_copy(update={"tp_size": len(prefill_agents)})
        except (KeyError, IndexError):
            raise ValueError(f"prefill ranks {list(prefill_agents)} are not connected") from None
        rank = self.layout.tp_rank
        plan = plan_writes(src, self.layout, [(0, 0)], seed)  # every page moves the same slices
        expected = plan.expected[rank] * num_pages * self.layout.num_layers
        senders = {prefill_agents[w.src_rank] for w in plan.writes if w.dst_rank == rank} if num_pages else set()
        if meta and rank == 0:
            expected += 1
            senders.add(prefill_agents[0])
        old = self._jobs.get(request_id)
        if old is not None and old.state is DecodeJobState.WAITING:
            raise ValueError(f"request {request_id} is already waiting for KV (epoch {old.epoch})")
        self._jobs[request_id] = _Expect(request_id, epoch, expected, senders, self.clock() + timeout_s)
        return expected

    @property
    def agents(self) -> list[str]:
        """The decode group's agents, by TP rank, as far as this side knows: itself."""
        return [self.transport.name]

    def forget(self, request_id: str) -> None:
        """Drop a request whose senders never heard of it (its prefill request was not delivered)."""
        self._jobs.pop(request_id, None)

    def abandon(self, request_id: str) -> int | None:
        """Failover: stop waiting for the current epoch and keep it as a fence (reported in
        ``lifted`` when no write can land); returns its epoch, or None if nothing waits."""
        job = self._jobs.get(request_id)
        if job is None or job.state is not DecodeJobState.WAITING:
            return None
        del self._jobs[request_id]
        self._end(job, DecodeJobState.ABORTED, "abandoned")
        self._fences[(request_id, job.epoch)] = job
        for agent in job.senders - job.closed:
            self.transport.send_notif(agent, Notification(NotifKind.ABORTED, request_id, job.epoch, 0).encode())
        return job.epoch

    def live(self) -> int:
        """Requests and fences this side still tracks (tests of bounded state)."""
        return len(self._jobs) + len(self._fences)

    def abort(self, request_id: str) -> None:
        """Stop waiting; tell the senders. Pages become releasable once no write can land."""
        job = self._jobs.get(request_id)
        if job is None or job.state >= DecodeJobState.FAILED:
            return
        if job.state is DecodeJobState.READY:
            del self._jobs[request_id]
            return
        self._end(job, DecodeJobState.ABORTED, "aborted")
        for agent in job.senders - job.closed:
            self.transport.send_notif(agent, Notification(NotifKind.ABORTED, request_id, job.epoch, 0).encode())

    def meta_slot(self, slot: int) -> torch.Tensor:
        return self.meta[slot]

    def poll(self) -> DecodePoll:
        for agent, raw in self.transport.notifications():
            try:
                note = Notification.decode(raw)
            except ValueError as exc:  # a bad peer costs its own message, never the loop
                self.malformed += 1
                log.warning("dropped a notification from %s: %s", agent, exc)
                continue
            self._on_notification(agent, note)
        now = self.clock()
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        releasable: list[str] = []
        epochs: dict[str, int] = {}
        for job in list(self._jobs.values()):
            epochs[job.request_id] = job.epoch
            if job.state is DecodeJobState.WAITING and job.got == job.expected:
                job.state = DecodeJobState.READY
            if job.state is DecodeJobState.WAITING and job.senders <= job.closed and job.posted < job.expected:
                self._end(job, DecodeJobState.FAILED, f"prefill stopped after {job.posted} of {job.expected} writes")
            elif job.state is DecodeJobState.WAITING and now > job.deadline:
                self._end(job, DecodeJobState.FAILED, f"KV transfer timed out: {job.got} of {job.expected} writes")
            if job.state is DecodeJobState.READY:
                ready.append(job.request_id)
                del self._jobs[job.request_id]
            elif job.state >= DecodeJobState.FAILED:
                if job.error is not None and job.state is DecodeJobState.FAILED:
                    failed.append((job.request_id, job.error))
                    job.error = None  # reported once
                if job.senders <= job.closed or now > job.ended_at + self.grace_s:
                    releasable.append(job.request_id)
                    del self._jobs[job.request_id]
        lifted = [k for k, f in self._fences.items() if f.senders <= f.closed or now > f.ended_at + self.grace_s]
        for key in lifted:
            del self._fences[key]
        reported = {*ready, *(rid for rid, _ in failed), *releasable}
        return DecodePoll(ready, failed, releasable, lifted, {r: e for r, e in epochs.items() if r in reported})

    def _end(self, job: _Expect, state: DecodeJobState, error: str) -> None:
        job.state, job.error, job.ended_at = state, f"request {job.request_id}: {error}", self.clock()
        if state is DecodeJobState.FAILED:  # tell the senders still open to stop (and to confirm it)
            for agent in job.senders - job.closed:
                self.transport.send_notif(agent, Notification(NotifKind.ABORTED, job.request_id, job.epoch, 0).encode())

    def _on_notification(self, agent: str, note: Notification) -> None:
        job = self._jobs.get(note.request_id)
        if job is None or job.epoch != note.epoch:
            job = self._fences.get((note.request_id, note.epoch))
            if job is None:
                self.stale += 1  # an old epoch (or a request already released): never counted
                return
        if note.kind is not NotifKind.REFUSED and agent not in job.senders:
            self.stale += 1  # not one of this epoch's senders: its counts are not this job's
            return
        if note.kind is NotifKind.REFUSED:  # nobody of that group will write: fail now, with its reason
            job.closed |= job.senders
            if job.state is DecodeJobState.WAITING:
                self._end(job, DecodeJobState.FAILED, f"refused by the prefill group: {note.reason}")
        elif note.kind in (NotifKind.KV, NotifKind.META):
            if job.state is DecodeJobState.WAITING:
                job.got += note.count
                if job.got > job.expected:
                    self._end(job, DecodeJobState.FAILED, f"received {job.got} writes, expected {job.expected}")
        elif agent not in job.closed:  # FIN / ABORTED: this sender will write nothing more for this epoch
            job.closed.add(agent)
            job.posted += note.count

"""The KV connectors: glue between an ``LLMEngine`` and a messenger side, through the engine's
port (``torch_engine/connector.py``: admit, before step, around the step, poll). The engine never
imports the messenger, and these links see the engine only as a ``ConnectorPort``.

``PrefillLink`` (prefill node, TP leader or TP 1): turns ``PrefillRequest``s into prefill-only
engine requests, tells the messenger which chunks each step runs (``before_step``, before the
forward pass), pins the source pages while they are being sent, hands over the last hidden
state (for the decoder's MTP drafter), and releases the pages when every write completed.

``DecodeLink`` (decode node): takes over the pages the engine's admission reserved and pinned
(``Reserved``), tells the messenger what to expect, builds the ``PrefillRequest`` to send, and
each step moves requests whose KV landed into the batch (``kv_ready``, with the prefill's last
hidden state when it asked for it) or fails them (``kv_failed``). Pages of a failed request
return to the pool only when the messenger says no write can still land.

Each link keeps one record per live request and drops it when the request leaves the link.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kv_messenger.layout import AttentionKind, KVLayoutSpec
from kv_messenger.prefill_side import PrefillJobState, PrefillOutcome
from kv_messenger.protocol import PrefillRequest
from kv_messenger.sides import DecodeMessenger, PrefillMessenger
from torch_engine.config import DType
from torch_engine.connector import ConnectorPoll, ConnectorPort, KVExport, Reserved
from torch_engine.request import FinishReason, RequestKind, RequestOutput
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.scheduler import SchedulerOutput


def engine_layout(kv: KVExport) -> KVLayoutSpec:
    """The messenger's descriptor of an engine's KV pools (``ConnectorPort.kv_export``)."""
    spec = kv.spec
    return KVLayoutSpec(
        kind=AttentionKind.MLA if spec.is_mla else AttentionKind.GQA,
        num_layers=spec.num_layers,
        page_size=spec.page_size,
        layout=spec.layout,
        dtype=DType.of(spec.dtype),
        tp_size=kv.tp_size,
        tp_rank=kv.tp_rank,
        latent_dim=spec.latent_dim if spec.is_mla else 0,
        kv_heads=0 if spec.is_mla else kv.kv_heads,
        head_dim=0 if spec.is_mla else spec.head_dim,
    )


def metadata_bytes(kv: KVExport) -> int:
    """Size of the metadata a prefill hands over: its last position's final hidden state, fp32
    (what an MTP drafter on the decoder needs to draft in its first step)."""
    return kv.hidden_size * 4


@dataclass(slots=True)
class _Source:
    """A prefill request whose source pages this link holds."""

    pinned: list[int] = field(default_factory=list)
    wants_meta: bool = False


class PrefillLink:
    """Prefill-side connector: a ``StepObserver`` attached to the engine (it must see each step's
    chunks before the forward pass), polled for the transfers that ended."""

    def __init__(self, engine: ConnectorPort, side: PrefillMessenger) -> None:
        self.engine = engine
        self.side = side
        self._jobs: dict[str, _Source] = {}
        self._reaped: list[PrefillOutcome] = []
        engine.attach(self)

    def submit(self, req: PrefillRequest) -> None:
        """``InvalidRequestError`` when the engine or the messenger refuses it (nothing was started)."""
        self.engine.add_request(
            req.prompt_ids,
            SamplingParams(cache_salt=req.cache_salt),
            request_id=req.request_id,
            kind=RequestKind.PREFILL_ONLY,
            want_last_hidden=req.meta_slot is not None,
        )
        try:
            self.side.submit(req)
        except ValueError as exc:
            self.engine.retire(req.request_id)
            raise InvalidRequestError(str(exc)) from None
        self._jobs[req.request_id] = _Source(wants_meta=req.meta_slot is not None)

    def before_step(self, sched: SchedulerOutput) -> None:
        forward = self.engine.next_forward()
        for c in sched.chunks:
            job = self._jobs.get(c.request.request_id)
            if job is None:
                continue
            fresh = c.request.pages[len(job.pinned) :]
            self.engine.pin_pages(fresh)  # the scheduler never preempts a request with pinned pages
            job.pinned += fresh
            self.side.schedule(c.request.request_id, forward, c.start + c.length, c.completes, c.request.pages)

    def after_forward(self, sched: SchedulerOutput) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        """One engine step plus the messenger bookkeeping; returns the engine's outputs."""
        outputs = self.engine.step()
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if out.finish_reason is not FinishReason.PREFILLED or job is None:
                continue
            self.side.prefill_done(out.request_id)
            if job.wants_meta:
                result = self.engine.prefill_result(out.request_id)
                assert result.last_hidden is not None
                self.side.set_metadata(out.request_id, result.last_hidden.float())
        self._reaped += self._release()
        return outputs

    def poll(self) -> list[PrefillOutcome]:
        """Release the source pages of requests whose transfers are over; returns them (including
        those that ``step`` already released since the last call)."""
        done, self._reaped = self._reaped + self._release(), []
        return done

    def _release(self) -> list[PrefillOutcome]:
        done = []
        for outcome in self.side.completed():
            rid = outcome.request_id
            job = self._jobs.pop(rid, None)
            if job is not None:
                self.engine.unpin_pages(job.pinned)
            if outcome.state is PrefillJobState.DONE:
                self.engine.release(rid)
            self.engine.retire(rid)
            done.append(outcome)
        return done

    def abort(self, request_id: str) -> None:
        self.side.abort(request_id)  # pages come back through poll() once no write is in flight

    def live(self) -> int:
        """Requests this link still holds (tests of bounded state)."""
        return len(self._jobs)


class Hold(enum.IntEnum):
    """Where a destination's current epoch stands with its pages.

    IN_FLIGHT ──ready / releasable / undelivered──> HANDED_ON
    IN_FLIGHT ──failover, fresh pages──> IN_FLIGHT (new epoch; the old pages fenced)
    IN_FLIGHT ──failover, no free pages──> FENCE_WAIT ──its fence lifted──> IN_FLIGHT (new epoch, same pages)
    FENCE_WAIT ──aborted──> HANDED_ON (the fence still holds the pages: they come back when it lifts)
    HANDED_ON, no fence left ──> the record is dropped
    """

    IN_FLIGHT = 0  # senders write into ``pages``, pinned by this link
    FENCE_WAIT = 1  # ``pages`` are the abandoned epoch ``epoch``'s, fenced; the next epoch starts on them
    HANDED_ON = 2  # the current epoch is over: its pages are the engine's (ready) or freed; fences may remain


@dataclass(slots=True)
class _Destination:
    """A decode request whose destination pages this link holds until no write can land."""

    pages: list[int]  # the current epoch's pages
    prompt_ids: list[int]
    hold: Hold = Hold.IN_FLIGHT
    epoch: int = -1
    slot: int | None = None
    fences: dict[int, list[int]] = field(default_factory=dict)  # abandoned epoch -> its pages, still pinned
    fenced_slots: dict[int, int] = field(default_factory=dict)  # abandoned epoch -> its metadata slot
    retry: list[str] = field(default_factory=list)  # FENCE_WAIT: the senders of the next epoch
    seed: int = 0
    first_page: int = 0  # the decoder's cached prefix: nobody writes those pages
    cache_salt: str | None = None


class DecodeLink:
    """Decode-side connector: polled between steps (``poll() -> ConnectorPoll``); it needs no step
    callbacks, so it is not attached to the engine.

    Pages are pinned from ``start`` until no write of the epoch that named them can land: ready
    (the engine takes them over), releasable (failed / aborted, every sender closed or the grace
    passed) or, for an epoch abandoned by ``failover``, lifted. ``failover`` moves the request to
    fresh pages when the pool has them (the new senders start at once) and otherwise waits for
    the abandoned epoch's fence before its pages are named again.
    """

    def __init__(
        self,
        engine: ConnectorPort,
        side: DecodeMessenger,
        prefill_agents: list[str] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.side = side
        self.prefill_agents = prefill_agents or []  # default senders; ``start`` may name others per request
        self.decode_agents = side.agents  # the decode group's ranks, by TP rank
        self.timeout_s = timeout_s
        self._slots = list(range(side.meta_slots))
        self._jobs: dict[str, _Destination] = {}
        self._retries: list[PrefillRequest] = []  # failovers whose fence lifted: to send
        self.fenced_pages = 0  # pages held by abandoned epochs (a gauge, read every report)
        self._meta_bytes = metadata_bytes(engine.kv_export())

    def start(
        self,
        reserved: Reserved,
        prompt_ids: list[int],
        seed: int = 0,
        meta: bool = False,
        prefill_agents: list[str] | None = None,
        cache_salt: str | None = None,
    ) -> PrefillRequest:
        """Take over the pages the engine's admission reserved and pinned (held until no write can
        land, whatever the engine does) and start counting; returns the request to send to the
        prefill node. ``ValueError`` (e.g. senders not connected): nothing was sent, the reservation
        is undone."""
        rid = reserved.request_id
        slot = self._slots.pop() if meta and self._slots else None
        self._jobs[rid] = _Destination(
            list(reserved.pages), list(prompt_ids), slot=slot, seed=seed, first_page=reserved.first_page,
            cache_salt=cache_salt,
        )  # fmt: skip
        try:
            return self._expect(rid, prefill_agents or self.prefill_agents)
        except ValueError:
            self._drop(rid)
            raise

    def cancel(self, reserved: Reserved) -> None:
        """Undo a reservation that was never started (no group to send it to)."""
        self.engine.unpin_pages(reserved.pages)
        self.engine.retire(reserved.request_id)

    def retarget(self, request_id: str, prefill_agents: list[str]) -> PrefillRequest:
        """The prefill request provably never reached its group (it was refused, or the connection
        was never made): same pages, a new epoch, other senders."""
        self.side.forget(request_id)
        return self._expect(request_id, prefill_agents)

    def failover(self, request_id: str, prefill_agents: list[str]) -> PrefillRequest | None:
        """The first group may have accepted the request (a timeout, a broken call): abandon its
        epoch (it is told to abort; its pages stay fenced) and start a new one on fresh pages —
        returned to send now — or, with too few free pages, on the same pages once the fence
        lifts (returned later by ``retries``)."""
        job = self._jobs[request_id]
        assert job.hold is Hold.IN_FLIGHT, f"failover of a request in {job.hold.name}"
        epoch = self.side.abandon(request_id)
        if epoch is None:  # nothing was waiting (it landed or failed meanwhile): nothing to move
            return None
        if job.slot is not None:  # a late metadata write may still land in the old slot
            job.fenced_slots[epoch] = job.slot
            job.slot = self._slots.pop() if self._slots else None
        try:
            fresh = self.engine.replace_kv_pages(request_id)
        except InvalidRequestError:
            job.fences[epoch] = job.pages
            self.fenced_pages += len(job.pages)
            job.hold, job.retry = Hold.FENCE_WAIT, list(prefill_agents)
            return None
        self.engine.pin_pages(fresh)
        job.fences[epoch], job.pages = job.pages, fresh
        self.fenced_pages += len(job.fences[epoch])
        return self._expect(request_id, prefill_agents)

    def retries(self) -> list[PrefillRequest]:
        """Failovers whose fence lifted since the last call: send these now."""
        out, self._retries = self._retries, []
        return out

    def _expect(self, rid: str, prefill_agents: list[str]) -> PrefillRequest:
        job = self._jobs[rid]
        assert job.hold is Hold.IN_FLIGHT
        job.epoch += 1
        self.side.expect(rid, job.epoch, prefill_agents, len(job.pages), job.seed, job.slot is not None, self.timeout_s)
        return PrefillRequest(
            request_id=rid,
            epoch=job.epoch,
            prompt_ids=job.prompt_ids,
            dst_pages=job.pages,
            first_page=job.first_page,
            decode_ranks=self.decode_agents,
            seed=job.seed,
            meta_slot=job.slot,
            ttl_s=self.timeout_s,
            cache_salt=job.cache_salt,
        )

    def waiting(self) -> bool:
        """Some request still waits for its KV or for its pages to become reusable."""
        return bool(self._jobs)

    def live(self) -> int:
        """Requests this link still holds (tests of bounded state)."""
        return len(self._jobs)

    def fenced(self) -> dict[str, list[int]]:
        """Pages held by abandoned epochs, by request (metrics, tests)."""
        return {rid: [p for pages in j.fences.values() for p in pages] for rid, j in self._jobs.items() if j.fences}

    def fail_undelivered(self, request_id: str, error: str) -> None:
        """The prefill request provably reached no group: no write can come; free its pages now
        (fences of earlier epochs stay until they lift)."""
        self.side.forget(request_id)
        self._hand_on(request_id)
        self.engine.kv_failed(request_id, error)

    def fail(self, request_id: str, error: str) -> None:
        """Give up on a request whose current senders may have accepted it: abort their epoch and
        fail it now; its pages come back once no write can land (``releasable``)."""
        self.side.abort(request_id)
        self.engine.kv_failed(request_id, error)

    def poll(self) -> ConnectorPoll:
        """Move landed requests into the batch and fail the others; returns what became ready,
        failed and releasable."""
        polled = self.side.poll()
        for rid in polled.ready:
            job = self._jobs.get(rid)
            hidden = None
            if job is not None and job.slot is not None:  # the prefill's last hidden state: the first draft
                hidden = self.side.meta_slot(job.slot)[: self._meta_bytes].view(torch.float32).clone()
            self._hand_on(rid)
            self.engine.kv_ready(rid, hidden)
        for rid, error in polled.failed:
            self.engine.kv_failed(rid, error)  # pages stay pinned (not reusable) until releasable
        for rid in polled.releasable:
            self._hand_on(rid)
        for rid, epoch in polled.lifted:
            self._lift(rid, epoch)
        return ConnectorPoll(list(polled.ready), list(polled.failed), list(polled.releasable))

    def abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None and job.hold is Hold.FENCE_WAIT:  # cancelled while waiting for a fence: no new epoch
            job.hold, job.retry = Hold.HANDED_ON, []  # the fence holds the pages; they come back when it lifts
        self.side.abort(request_id)
        self.engine.abort(request_id)

    def _lift(self, rid: str, epoch: int) -> None:
        job = self._jobs.get(rid)
        if job is None:
            return
        pages = job.fences.pop(epoch, None)
        self.fenced_pages -= len(pages or ())
        slot = job.fenced_slots.pop(epoch, None)
        if slot is not None:
            self._slots.append(slot)
        if job.hold is Hold.FENCE_WAIT and epoch == job.epoch:  # failover waiting for its own pages: go now
            agents, job.retry = job.retry, []
            job.hold = Hold.IN_FLIGHT  # the fence's pin is the new epoch's
            self._retries.append(self._expect(rid, agents))
        elif pages is not None:
            self.engine.unpin_pages(pages)
        self._maybe_drop(rid)

    def _hand_on(self, rid: str) -> None:
        """The current epoch is over: its pages are the engine's alone now (ready, or freed)."""
        job = self._jobs.get(rid)
        if job is None:
            return
        if job.hold is Hold.IN_FLIGHT:  # in FENCE_WAIT the fence holds them: unpinned when it lifts
            self.engine.unpin_pages(job.pages)
        job.hold, job.retry = Hold.HANDED_ON, []
        if job.slot is not None:
            self._slots.append(job.slot)
            job.slot = None
        self._maybe_drop(rid)

    def _maybe_drop(self, rid: str) -> None:
        job = self._jobs[rid]
        if job.hold is Hold.HANDED_ON and not job.fences:
            del self._jobs[rid]

    def _drop(self, rid: str) -> None:
        """Undo a reservation that never went out."""
        self._hand_on(rid)
        self.engine.retire(rid)

"""A decode leader's request path (DESIGN section 5): reserve, route, ask for a prefill, wait, decode.

``KVFetcher`` is the ``KVSource`` of the decode node's ``DecodeLoop``. Per request:

    admit ──too few free pages to reserve──> QUEUED (in arrival order) ──pages free──> admitted as below
    admit ──reserve + pin pages, pick a group (Router), send PrefillRequest (Triton gRPC, async)──> SENT
    SENT ──the call was refused / never connected──> another group (same pages, new epoch) or FAILED
    SENT ──the call timed out / broke (the group may have taken it)──> the epoch is abandoned (its
          senders told to abort, its pages fenced) -> another group on fresh pages, or on the same
          pages once the fence lifts; or FAILED (pages back once no write can land)
    SENT ──the prefill group refused it after the call (REFUSED notification)──> FAILED with its reason
    SENT ──every rank of the decode group counted all writes──> READY (joins the batch)
    SENT ──transfer timed out / prefill stopped short──> FAILED (pages freed once no write can land)

The gRPC replies arrive on client threads and are queued (``prefill_client``); everything else
runs on the engine loop thread. Each request's server-side timestamps go to an optional trace (``Tracer``).
"""

from __future__ import annotations

import logging
import queue
import zlib
from collections import deque
from dataclasses import dataclass, field

from kv_messenger.protocol import PrefillRequest
from serving.kv_links import DecodeLink
from serving.prefill_client import Caller, CallerFactory, Delivery, PrefillCaller, PrefillGroup, Reply
from serving.router import NoPrefillGroup, Router
from serving.tp_group import GroupDecodeSide
from serving.trace import Tracer
from torch_engine.engine import LLMEngine
from torch_engine.sampling import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Queued:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Pending:
    group: int
    epoch: int
    tried: set[int] = field(default_factory=set)


class KVFetcher:
    def __init__(
        self,
        engine: LLMEngine,
        side: GroupDecodeSide,
        groups: list[PrefillGroup],
        kv_timeout_s: float,
        call_timeout_s: float,
        tracer: Tracer | None = None,
        caller: CallerFactory | None = None,
        auth_key: str | None = None,
    ) -> None:
        if not groups:
            raise ValueError("a disaggregated decode node needs at least one prefill group")
        self.engine = engine
        self.link = DecodeLink(engine, side, timeout_s=kv_timeout_s)
        self.groups = groups
        self.router = Router(len(groups))
        self.tracer = tracer
        self._replies: queue.Queue[Reply] = queue.Queue()
        if caller is None:
            self.callers: list[Caller] = [PrefillCaller(g, call_timeout_s, self._replies, auth_key) for g in groups]
        else:
            self.callers = [caller(g, call_timeout_s, self._replies) for g in groups]
        self._pending: dict[str, _Pending] = {}
        self._queued: deque[_Queued] = deque()  # admitted, waiting for free pages to reserve

    # -- KVSource ------------------------------------------------------------------------
    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> bool:
        if len(prompt_ids) < 2:
            return False  # nothing to prefill: the decoder runs the single token itself
        self.engine.check_prompt(prompt_ids)  # one that can never fit fails now, not after a wait
        if self.tracer is not None:
            self.tracer.mark(request_id, "arrived", prompt_tokens=len(prompt_ids))
        if self._queued or not self.engine.can_reserve(len(prompt_ids) - 1):
            self._queued.append(_Queued(request_id, prompt_ids, params))  # waits for pages, in order
            return True
        self._start(request_id, prompt_ids, params)
        return True

    def _start(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            g = self.router.pick()
        except NoPrefillGroup as exc:
            raise InvalidRequestError(str(exc)) from None
        try:
            agents = self.groups[g].agents
            meta = self.engine.wants_prefill_hidden  # an MTP drafter drafts its first step from it
            req = self.link.start(prompt_ids, params, request_id, _seed(request_id), meta, agents)
        except ValueError as exc:
            raise InvalidRequestError(f"request {request_id}: {exc}") from None
        self._pending[request_id] = _Pending(g, req.epoch, {g})
        self._send(g, req)

    def tick(self) -> list[tuple[str, str]]:
        failures = self._replies_in()
        while self._queued and self.engine.can_reserve(len(self._queued[0].prompt_ids) - 1):
            q = self._queued.popleft()
            try:
                self._start(q.request_id, q.prompt_ids, q.params)
            except InvalidRequestError as exc:
                failures.append((q.request_id, str(exc)))
        polled = self.link.poll()
        for req in self.link.retries():  # failovers whose fence lifted
            p = self._pending.get(req.request_id)
            if p is not None:
                p.epoch = req.epoch
                self._send(p.group, req)
        for rid in polled.ready:
            p = self._pending.pop(rid, None)
            if p is not None:
                self.router.finished(p.group, rid)
            if self.tracer is not None:
                self.tracer.mark(rid, "kv_ready")
        for rid, error in polled.failed:
            p = self._pending.pop(rid, None)
            if p is not None:
                self.router.finished(p.group, rid)
            failures.append((rid, error))
        return failures

    def busy(self) -> bool:
        return bool(self._pending or self._queued) or self.link.waiting() or not self._replies.empty()

    def records(self) -> dict[str, int]:
        return {
            "queued": len(self._queued),
            "fetches": len(self._pending),
            "destinations": self.link.live(),
            "fenced_pages": self.link.fenced_pages,
            "messenger": self.link.side.live(),
        }

    def cancel(self, request_id: str) -> bool:
        for q in self._queued:
            if q.request_id == request_id:
                self._queued.remove(q)
                return True
        p = self._pending.pop(request_id, None)
        if p is None:
            return False
        self.router.finished(p.group, request_id)
        self.link.abort(request_id)
        return True

    def close(self) -> None:
        for c in self.callers:
            c.close()

    # -- internals -----------------------------------------------------------------------
    def _send(self, group: int, req: PrefillRequest) -> None:
        self.router.sent(group, req.request_id, len(req.prompt_ids) - 1)
        if self.tracer is not None:
            self.tracer.mark(req.request_id, "sent", group=group)
        self.callers[group].call(req)

    def _replies_in(self) -> list[tuple[str, str]]:
        failures: list[tuple[str, str]] = []
        while True:
            try:
                r = self._replies.get_nowait()
            except queue.Empty:
                return failures
            p = self._pending.get(r.request_id)
            if p is None or p.epoch != r.epoch:
                continue  # answered after the request moved on
            if r.error is None:
                assert r.load_tokens is not None
                self.router.reported(r.group, r.load_tokens)
                continue
            log.warning("prefill group %d: %s failed (%s): %s", r.group, r.request_id, r.delivery.name, r.error)
            if r.delivery is Delivery.REFUSED:  # this request's problem, not the group's: no cool-down
                self.router.finished(r.group, r.request_id)
            else:
                self.router.failed(r.group, r.request_id)
            maybe_taken = r.delivery is Delivery.UNKNOWN
            try:
                g = self.router.pick(exclude=p.tried)
            except NoPrefillGroup:
                error = f"request {r.request_id}: no prefill group could take it (last error: {r.error})"
                self._pending.pop(r.request_id)
                if maybe_taken:
                    self.link.fail(r.request_id, error)  # pages back once no write can land
                else:
                    self.link.fail_undelivered(r.request_id, error)
                failures.append((r.request_id, error))
                continue
            p.group = g
            p.tried.add(g)
            agents = self.groups[g].agents
            if maybe_taken:
                moved = self.link.failover(r.request_id, agents)  # None: waits for the fence (or landed)
                if moved is not None:
                    p.epoch = moved.epoch
                    self._send(g, moved)
            else:
                req = self.link.retarget(r.request_id, agents)
                p.epoch = req.epoch
                self._send(g, req)


def _seed(request_id: str) -> int:
    """Spreads source replicas (MLA) over requests; both sides compute the same plan from it."""
    return zlib.crc32(request_id.encode()) & 0x7FFFFFFF

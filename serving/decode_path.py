"""A decode leader's request path (DESIGN section 5): reserve, route, ask for a prefill, wait, decode.

``KVFetcher`` is the ``KVSource`` of the decode node's ``DecodeLoop``. Per request:

    admit: one engine call (``admit_for_kv``: validate, report load, place, reserve + pin) ──
    admit ──one-token prompt, or the placement rule says prefill here (planner/placement.py), or (auto)
          no prefill group is in rotation──> the engine
    admit ──too few free pages to reserve──> QUEUED (in arrival order) ──pages free──> admitted as below;
          one refused for want of pages is passed by later ones that fit until it has waited
          ``head_of_line_s``, then nothing passes it (small prompts are not held behind a big one,
          and the big one is not starved)
    admit ──reserved + pinned, pick a group (Router), send PrefillRequest (Triton gRPC, async)──> SENT
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
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

from kv_messenger.protocol import PrefillRequest
from planner.placement import PlacementInputs, PlacementSpec, PrefillPlacement, decide
from serving.kv_links import DecodeLink
from serving.prefill_client import Caller, CallerFactory, Delivery, PrefillCaller, PrefillGroup, Reply
from serving.registry import Membership
from serving.router import NoPrefillGroup, Router
from serving.tp_group import GroupDecodeSide
from serving.trace import Tracer
from torch_engine.connector import (
    Accepted,
    ConnectorPort,
    EngineLoad,
    Placement,
    RefusalReason,
    Refused,
    Reserved,
)
from torch_engine.sampling import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    blocked_since: float | None = None  # when it was first refused for want of pages


BYPASS_SCAN = 4  # queued requests looked at past a blocked head per pass (each costs an admission try)


@dataclass(slots=True)
class _Pending:
    group: int
    epoch: int
    tried: set[int] = field(default_factory=set)


class KVFetcher:
    def __init__(
        self,
        engine: ConnectorPort,
        side: GroupDecodeSide,
        groups: list[PrefillGroup],
        kv_timeout_s: float,
        call_timeout_s: float,
        tracer: Tracer | None = None,
        caller: CallerFactory | None = None,
        auth_key: str | None = None,
        membership: Membership | None = None,
        placement: PlacementSpec | None = None,
        head_of_line_s: float = 5.0,
    ) -> None:
        if not groups:
            raise ValueError("a disaggregated decode node needs at least one prefill group")
        self.membership = membership  # prefill groups dying and coming back (a deployment's registry)
        self.head_of_line_s = head_of_line_s
        self.placement = placement or PlacementSpec()
        self._costs = self.placement.cost_models()
        self.local_prefills = self.remote_prefills = 0  # where prompts of two or more tokens were prefilled
        self.engine = engine
        self.side = side
        self.link = DecodeLink(engine, side, timeout_s=kv_timeout_s)
        self.groups = groups
        self.router = Router(len(groups))
        self.tracer = tracer
        self._replies: queue.Queue[Reply] = queue.Queue()
        if caller is None:

            def caller(g: PrefillGroup, timeout_s: float, replies: queue.Queue[Reply]) -> Caller:
                return PrefillCaller(g, timeout_s, replies, auth_key)

        self._caller, self._call_timeout_s = caller, call_timeout_s
        self.callers = [caller(g, call_timeout_s, self._replies) for g in groups]
        self._pending: dict[str, _Pending] = {}
        self._queued: deque[_Queued] = deque()  # admitted, waiting for free pages to reserve

    # -- KVSource ------------------------------------------------------------------------
    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """One engine call (``admit_for_kv``): validated, placed by the placement rule, and either
        queued on this engine, reserved and sent, or queued here for pages (in arrival order).
        ``InvalidRequestError`` when the engine can never take it, or no prefill group can."""
        adm = self.engine.admit_for_kv(prompt_ids, params, request_id, lambda load, n: self._place(request_id, load, n))
        match adm:
            case Reserved():
                self._start(adm, prompt_ids, params.cache_salt)
            case Refused(reason=RefusalReason.INVALID):
                raise InvalidRequestError(adm.message)
            case Accepted(placement=Placement.LOCAL):
                pass  # the engine prefills it itself
            case Refused() | Accepted():  # no room now, or behind requests waiting for pages
                self._queued.append(_Queued(request_id, prompt_ids, params))

    def _place(self, request_id: str, load: EngineLoad, uncached: int) -> Placement:
        """``uncached``: prompt tokens past what this decoder's prefix cache holds (what either side computes)."""
        if self._local(request_id, uncached, load):
            return Placement.LOCAL
        self.remote_prefills += 1
        if self.tracer is not None:
            self.tracer.mark(request_id, "arrived", uncached_tokens=uncached)
        return Placement.HOLD if self._queued else Placement.REMOTE

    def _local(self, request_id: str, prompt_tokens: int, load: EngineLoad) -> bool:
        """The placement rule: prefill this prompt on this engine (True) or at a prefill group.
        ``prompt_tokens``: those past the decoder's cache hit (at most ``local_max_tokens``: here)."""
        mode = self.placement.mode
        if prompt_tokens <= self.placement.local_max_tokens:
            self.local_prefills += 1
            if self.tracer is not None:
                self.tracer.mark(request_id, "placed", where="local", uncached_tokens=prompt_tokens)
            return True
        if mode is PrefillPlacement.REMOTE:
            return False
        groups = [g for g in range(len(self.groups)) if self.router.available(g)]
        if self._costs is None or not groups:  # LOCAL; or AUTO with every prefill group down: serve it here
            local, est = True, None
        else:
            queue = min(self.router.load(g) for g in groups)
            x = PlacementInputs(prompt_tokens, load.decoding, load.mean_context, load.prefill_tokens, queue, load.chunk)
            est = decide(x, *self._costs, self.placement.overhead_s, mode, self.placement.itl_budget_s)
            local = est.local
        if local:
            self.local_prefills += 1
        if self.tracer is not None and est is not None:
            self.tracer.mark(
                request_id, "placed", where="local" if local else "remote", local_s=round(est.local_s, 4),
                remote_s=round(est.remote_s, 4), stall_s=round(est.stall_s, 4), decoding=load.decoding,
            )  # fmt: skip
        return local

    def _start(self, reserved: Reserved, prompt_ids: list[int], cache_salt: str | None) -> None:
        rid = reserved.request_id
        try:
            g = self.router.pick()
        except NoPrefillGroup as exc:
            self.link.cancel(reserved)
            raise InvalidRequestError(str(exc)) from None
        try:
            agents = self.groups[g].agents
            meta = self.engine.wants_prefill_hidden  # an MTP drafter drafts its first step from it
            req = self.link.start(reserved, prompt_ids, _seed(rid), meta, agents, cache_salt)
        except ValueError as exc:
            raise InvalidRequestError(f"request {rid}: {exc}") from None
        self._pending[rid] = _Pending(g, req.epoch, {g})
        self._send(g, req)

    def tick(self) -> list[tuple[str, str]]:
        failures = self._membership() if self.membership is not None else []
        failures += self._replies_in()
        failures += self._drain()
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

    def _drain(self) -> list[tuple[str, str]]:
        """Start queued requests in arrival order while the engine has pages for them; one refused for
        want of pages is passed by later ones that fit (``BYPASS_SCAN`` looked at per pass) until it has
        waited ``head_of_line_s``: then the ones behind it wait for it."""
        failures: list[tuple[str, str]] = []
        now, i, blocked = time.monotonic(), 0, 0
        while i < len(self._queued) and blocked <= BYPASS_SCAN:
            q = self._queued[i]
            adm = self.engine.admit_for_kv(q.prompt_ids, q.params, q.request_id, _remote)
            if isinstance(adm, Refused) and adm.reason is RefusalReason.NO_ROOM:
                q.blocked_since = now if q.blocked_since is None else q.blocked_since
                if now - q.blocked_since >= self.head_of_line_s:
                    break
                i, blocked = i + 1, blocked + 1
                continue
            del self._queued[i]
            match adm:
                case Reserved():
                    try:
                        self._start(adm, q.prompt_ids, q.params.cache_salt)
                    except InvalidRequestError as exc:
                        failures.append((q.request_id, str(exc)))
                case Refused():
                    failures.append((q.request_id, adm.message))
                case Accepted():
                    pass  # a one-token prompt: the engine runs it
        return failures

    def busy(self) -> bool:
        return bool(self._pending or self._queued) or self.link.waiting() or not self._replies.empty()

    def records(self) -> dict[str, int]:
        return {
            "queued": len(self._queued),
            "fetches": len(self._pending),
            "destinations": self.link.live(),
            "fenced_pages": self.link.fenced_pages,
            "messenger": self.side.live(),
        }

    def prefill_counts(self) -> tuple[int, int]:
        return self.local_prefills, self.remote_prefills

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
            failures += self._move(r.request_id, p, r.error, maybe_taken)

    def _move(self, rid: str, p: _Pending, error: str, maybe_taken: bool) -> list[tuple[str, str]]:
        """Send a request whose group failed it to another group (same pages when the first never
        took it; fresh pages, or the same once the fence lifts, when it may have); fail it when no
        group is left. Returns the failure, if any."""
        try:
            g = self.router.pick(exclude=p.tried)
        except NoPrefillGroup:
            message = f"request {rid}: no prefill group could take it (last error: {error})"
            self._pending.pop(rid)
            if maybe_taken:
                self.link.fail(rid, message)  # pages back once no write can land
            else:
                self.link.fail_undelivered(rid, message)
            return [(rid, message)]
        p.group = g
        p.tried.add(g)
        if self.tracer is not None:
            self.tracer.mark(rid, "moved", moves=len(p.tried) - 1)  # its first move's time, and how many
        agents = self.groups[g].agents
        if maybe_taken:
            moved = self.link.failover(rid, agents)  # None: waits for the fence (or landed)
            if moved is not None:
                p.epoch = moved.epoch
                self._send(g, moved)
        else:
            req = self.link.retarget(rid, agents)
            p.epoch = req.epoch
            self._send(g, req)
        return []

    def _membership(self) -> list[tuple[str, str]]:
        """Prefill groups that died leave routing, and the requests they held move on (their epoch
        abandoned: the dead senders' pages are fenced); groups that came back (a new generation,
        new agents) are connected and rejoin."""
        assert self.membership is not None
        change = self.membership.poll()
        if change is None:
            return []
        failures: list[tuple[str, str]] = []
        for _, g in change.left:
            log.warning("prefill group %d left the deployment: its requests move to other groups", g)
            self.router.leave(g)
            for rid, p in list(self._pending.items()):
                if p.group == g:
                    self.router.finished(g, rid)
                    failures += self._move(rid, p, f"prefill group {g} died", maybe_taken=True)
        for record in change.joined:
            g = record.group
            if g >= len(self.groups):
                log.warning("prefill group %d is not in this deployment's configuration: ignored", g)
                continue
            log.info("prefill group %d is up (generation %d): connecting", g, record.generation)
            self.side.connect(record.endpoints)
            self.groups[g] = PrefillGroup.of(record)
            self.callers[g].close()
            self.callers[g] = self._caller(self.groups[g], self._call_timeout_s, self._replies)
            self.router.rejoin(g)
        return failures


def _remote(load: EngineLoad, prompt_tokens: int) -> Placement:
    """A queued request was placed when it arrived: reserve its pages now."""
    return Placement.REMOTE


def _seed(request_id: str) -> int:
    """Spreads source replicas (MLA) over requests; both sides compute the same plan from it."""
    return zlib.crc32(request_id.encode()) & 0x7FFFFFFF

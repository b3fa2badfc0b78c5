"""A discrete-event simulator of a serving deployment, step by step, driven by cost curves.

Engines (instances) run continuous batching the way ``torch_engine``'s scheduler does: every step
takes all decoding sequences (one token each), then the requests whose KV just landed (their last
prompt token), then prompt chunks first-come-first-served within the step's token budget. A step
lasts ``CostModel.step_s(decodes, mean context, prefill tokens)``. Nothing is a closed formula:
queues, batch sizes and contexts evolve request by request.

Events (a heap ordered by time):

    ARRIVE(request) ──colocated──> an engine's prefill queue (round-robin, as the benchmark's clients)
    ARRIVE(request) ──disaggregated──> a decode engine (round-robin): KV reserved (or it waits for room);
        the placement rule (``planner/placement.py``) keeps it there (local prefill) or sends it to the
        prefill engine with the fewest outstanding tokens
    STEP_END(engine) ──> decodes advance, finished requests leave (their KV freed), finished prompts
        yield their first token (local) or start their transfer (prefill engines); the engine starts
        its next step if it has work
    LANDED(request, decode engine) ──> joins that engine's next step (the loop notices landed KV at
        step boundaries)

Handovers: ``DECODE_STEP`` (this engine: the prefill computes all but the last prompt token, the
decode's first step runs it and yields token 1) or ``PREFILL_TOKEN`` (Dynamo / SGLang style: the
prefill samples token 1, TTFT ends there). With layer streaming only the last post's share of the
transfer is exposed (``exposed_share``).
"""

from __future__ import annotations

import enum
import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from planner.placement import PlacementInputs, PrefillPlacement, decide
from planner.profile import CostModel
from planner.workload import SLO


class Mode(enum.IntEnum):
    COLOCATED = 0
    DISAGGREGATED = 1


class Handover(enum.IntEnum):
    DECODE_STEP = 0
    PREFILL_TOKEN = 1


@dataclass(frozen=True, slots=True)
class Role:
    costs: CostModel
    instances: int
    chunk: int  # token budget per step
    max_seqs: int = 256


@dataclass(frozen=True, slots=True)
class Deployment:
    mode: Mode
    decode: Role  # colocated: the only role
    prefill: Role | None = None
    placement: PrefillPlacement = PrefillPlacement.REMOTE
    overhead_s: float = 0.02  # a remote prefill's round trip (call, notification)
    handover: Handover = Handover.DECODE_STEP
    exposed_share: float = 1.0  # share of the KV transfer after the prefill ends (layer streaming: the last post's)
    request_overhead_s: float = 0.0  # client -> engine (tokenising, RPCs, the server's queues), before any step
    itl_budget_s: float | None = None  # auto placement: the longest chunk step a local prefill may add (PlacementSpec)

    @property
    def devices(self) -> int:
        d = self.decode.instances * self.decode.costs.profile.devices
        if self.prefill is not None:
            d += self.prefill.instances * self.prefill.costs.profile.devices
        return d


@dataclass(slots=True)
class _Req:
    i: int
    arrival: float
    prompt: int
    output: int
    todo: int = 0  # prompt tokens still to compute where it is prefilled
    produced: int = 0
    local: bool = True
    first: float = math.nan
    last: float = math.nan
    scheduled: float = math.nan
    prefilled: float = math.nan
    landed: float = math.nan
    decode_at: int = -1  # the decode engine it belongs to (disaggregated)


@dataclass(slots=True)
class _Step:
    decodes: int
    chunks: list[tuple[_Req, int]]
    joiners: list[_Req]


class _Engine:
    def __init__(self, index: int, role: Role, prefill_only: bool) -> None:
        self.index, self.role, self.prefill_only = index, role, prefill_only
        self.waiting: deque[_Req] = deque()  # prompts to prefill here, FCFS (the head may be part done)
        self.joiners: list[_Req] = []  # KV landed: their last prompt token joins the next step
        self.ready: list[_Req] = []  # first token already out (PREFILL_TOKEN): decode from the next step
        self.finish_heap: list[tuple[int, int, _Req]] = []  # (step of the last token, i, request)
        self.decoding = 0
        self.context_sum = 0
        self.steps = 0
        self.busy = False
        self.busy_s = 0.0
        self.held_tokens = 0  # KV reserved (prompt + output of resident requests)
        self.blocked: deque[_Req] = deque()  # waiting for KV room

    @property
    def outstanding(self) -> int:
        return sum(r.todo for r in self.waiting)

    def fits(self, r: _Req) -> bool:
        cap = self.role.costs.profile.max_batch_tokens
        return cap is None or self.held_tokens + r.prompt + r.output <= cap

    def compose(self) -> _Step | None:
        budget = max(self.role.chunk - self.decoding, 0)
        joiners, self.joiners = self.joiners[: self.role.max_seqs], self.joiners[self.role.max_seqs :]
        budget = max(budget - len(joiners), 0)
        chunks: list[tuple[_Req, int]] = []
        for r in self.waiting:
            if budget <= 0 or self.decoding + len(joiners) + len(chunks) >= self.role.max_seqs:
                break
            n = min(r.todo, budget)
            chunks.append((r, n))
            budget -= n
        if not (self.decoding or joiners or chunks or self.ready):
            return None
        return _Step(self.decoding, chunks, joiners)

    def step_s(self, s: _Step) -> float:
        seqs = s.decodes + len(s.joiners)
        ctx = (self.context_sum + sum(r.prompt for r in s.joiners)) / seqs if seqs else 0.0
        return self.role.costs.step_s(seqs, ctx, sum(n for _, n in s.chunks))


@dataclass(frozen=True, slots=True)
class RequestResult:
    prompt: int
    output: int
    ttft: float | None  # None: not finished within the bound (a miss)
    tpot: float | None
    local: bool
    queue: float | None = None
    prefill: float | None = None
    transfer: float | None = None
    handover: float | None = None


@dataclass(slots=True)
class SimResult:
    rate: float
    requests: list[RequestResult]
    wall_s: float
    utilization: dict[str, float] = field(default_factory=dict)  # role -> busy share of its engines

    def attainment(self, slo: SLO) -> float:
        ok = sum(
            1 for r in self.requests if r.ttft is not None and r.tpot is not None
            and r.ttft <= slo.ttft_s and r.tpot <= slo.tpot_s
        )  # fmt: skip
        return ok / len(self.requests) if self.requests else 0.0

    def pct(self, what: str, q: float) -> float | None:
        xs = sorted(v for r in self.requests if (v := getattr(r, what)) is not None)
        if not xs:
            return None
        return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]

    def median(self, what: str) -> float | None:
        xs = [v for r in self.requests if (v := getattr(r, what)) is not None]
        return statistics.median(xs) if xs else None

    @property
    def local_share(self) -> float:
        return sum(r.local for r in self.requests) / len(self.requests) if self.requests else 0.0


class Simulator:
    ARRIVE, STEP_END, LANDED = 0, 1, 2

    def __init__(self, dep: Deployment) -> None:
        if dep.mode is Mode.DISAGGREGATED and dep.prefill is None:
            raise ValueError("a disaggregated deployment needs a prefill role")
        self.dep = dep

    def run(self, requests: list[tuple[int, int]], arrivals: list[float], rate: float, bound_s: float) -> SimResult:
        dep = self.dep
        self._decode = [_Engine(i, dep.decode, False) for i in range(dep.decode.instances)]
        self._prefill = [_Engine(i, dep.prefill, True) for i in range(dep.prefill.instances)] if dep.prefill else []
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        reqs = [_Req(i, t, p, o) for i, ((p, o), t) in enumerate(zip(requests, arrivals, strict=True))]
        for r in reqs:
            self._push(r.arrival + dep.request_overhead_s, self.ARRIVE, r)
        now = 0.0
        while self._events:
            now, _, kind, obj = heapq.heappop(self._events)
            if now > bound_s:
                now = bound_s
                break
            if kind == self.ARRIVE:
                assert isinstance(obj, _Req)
                self._arrive(obj, now)
            elif kind == self.STEP_END:
                assert isinstance(obj, tuple)
                self._step_end(obj[0], obj[1], now)
            else:
                assert isinstance(obj, _Req)
                self._landed(obj, now)
        util = {"decode" if dep.mode is Mode.DISAGGREGATED else "colocated": _busy(self._decode, now)}
        if self._prefill:
            util["prefill"] = _busy(self._prefill, now)
        return SimResult(rate, [_result(r) for r in reqs], now, util)

    # -- events --------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def _arrive(self, r: _Req, now: float) -> None:
        d = self._decode[r.i % len(self._decode)]
        r.decode_at = d.index
        if not d.fits(r):
            d.blocked.append(r)
            return
        self._admit(d, r, now)

    def _admit(self, d: _Engine, r: _Req, now: float) -> None:
        d.held_tokens += r.prompt + r.output
        if self.dep.mode is Mode.COLOCATED or r.prompt < 2 or self._keep_local(d, r):
            r.local, r.todo = True, r.prompt
            d.waiting.append(r)
            self._start(d, now)
            return
        r.local = False
        p = min(self._prefill, key=lambda e: (e.outstanding, e.index))
        r.todo = r.prompt - 1 if self.dep.handover is Handover.DECODE_STEP else r.prompt
        p.waiting.append(r)
        self._start(p, now)

    def _keep_local(self, d: _Engine, r: _Req) -> bool:
        dep = self.dep
        if dep.placement is PrefillPlacement.REMOTE:
            return False
        if dep.placement is PrefillPlacement.LOCAL:
            return True
        assert dep.prefill is not None
        ctx = d.context_sum / d.decoding if d.decoding else 0.0
        queue = min(e.outstanding for e in self._prefill)
        x = PlacementInputs(r.prompt, d.decoding, ctx, d.outstanding, queue, dep.decode.chunk)
        return decide(x, dep.decode.costs, dep.prefill.costs, dep.overhead_s, dep.placement, dep.itl_budget_s).local

    def _start(self, e: _Engine, now: float) -> None:
        if e.busy:
            return
        # requests whose first token came from the prefill decode from this step on
        for r in e.ready:
            self._to_decoding(e, r, e.steps + 1)
        e.ready = []
        s = e.compose()
        if s is None:
            return
        for r, _ in s.chunks:
            if math.isnan(r.scheduled):
                r.scheduled = now
        dur = e.step_s(s)
        e.busy, e.busy_s = True, e.busy_s + dur
        self._push(now + dur, self.STEP_END, (e, s))

    def _to_decoding(self, e: _Engine, r: _Req, from_step: int) -> None:
        """``r`` has ``produced`` tokens; it makes one more in every step from ``from_step`` on."""
        last_step = from_step + (r.output - r.produced) - 1
        heapq.heappush(e.finish_heap, (last_step, r.i, r))
        e.decoding += 1
        e.context_sum += r.prompt + r.produced

    def _step_end(self, e: _Engine, s: _Step, now: float) -> None:
        e.busy = False
        e.steps += 1
        e.context_sum += s.decodes
        while e.finish_heap and e.finish_heap[0][0] <= e.steps:
            _, _, r = heapq.heappop(e.finish_heap)
            r.produced, r.last = r.output, now
            e.decoding -= 1
            e.context_sum -= r.prompt + r.output
            self._release(e, r, now)
        for r in s.joiners:
            self._first_token(e, r, now)
        for r, n in s.chunks:
            r.todo -= n
            if r.todo > 0:
                continue
            e.waiting.remove(r)
            if e.prefill_only:
                self._prefill_done(r, now)
            else:
                r.prefilled = now
                self._first_token(e, r, now)
        self._start(e, now)

    def _first_token(self, e: _Engine, r: _Req, now: float) -> None:
        r.first, r.produced = now, 1
        if r.output <= 1:
            r.last = now
            self._release(e, r, now)
        else:
            self._to_decoding(e, r, e.steps + 1)

    def _release(self, d: _Engine, r: _Req, now: float) -> None:
        """``r`` left its decode engine ``d``: its KV room goes to the requests waiting for it."""
        d.held_tokens -= r.prompt + r.output
        while d.blocked and d.fits(d.blocked[0]):
            self._admit(d, d.blocked.popleft(), now)

    def _prefill_done(self, r: _Req, now: float) -> None:
        dep = self.dep
        assert dep.prefill is not None
        r.prefilled = now
        moved = r.prompt - 1 if dep.handover is Handover.DECODE_STEP else r.prompt
        transfer = dep.prefill.costs.transfer_s(moved)
        exposed = transfer * dep.exposed_share
        if dep.handover is Handover.PREFILL_TOKEN:
            r.first, r.produced = now + dep.overhead_s / 2, 1  # the token goes back with the reply
        self._push(now + exposed + dep.overhead_s, self.LANDED, r)

    def _landed(self, r: _Req, now: float) -> None:
        r.landed = now
        d = self._decode[r.decode_at]
        if self.dep.handover is Handover.DECODE_STEP:
            d.joiners.append(r)
        elif r.output <= 1:
            r.last = r.first
            self._release(d, r, now)
            return
        else:
            d.ready.append(r)
        self._start(d, now)


def _busy(engines: list[_Engine], now: float) -> float:
    return sum(e.busy_s for e in engines) / (len(engines) * now) if engines and now > 0 else 0.0


def _result(r: _Req) -> RequestResult:
    if math.isnan(r.last) or math.isnan(r.first):
        return RequestResult(r.prompt, r.output, None, None, r.local)
    tpot = (r.last - r.first) / (r.output - 1) if r.output > 1 else 0.0

    def span(a: float, b: float) -> float | None:
        return None if math.isnan(a) or math.isnan(b) else b - a

    waited = min(r.landed, r.first)  # a first token sampled by the prefill does not wait for the KV
    return RequestResult(
        r.prompt, r.output, r.first - r.arrival, tpot, r.local,
        span(r.arrival, r.scheduled), span(r.scheduled, r.prefilled),
        None if r.local else span(r.prefilled, waited), None if r.local else span(waited, r.first),
    )  # fmt: skip

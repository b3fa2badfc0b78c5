"""A prefill node's serving loop (a ``ServingLoop``): the engine plus its messenger, one thread.

``PrefillLoop`` owns an ``LLMEngine`` (prefill role), a ``PrefillSide`` and the
``PrefillLink`` between them. ``handshake`` connects decode ranks and returns this node's
endpoint; ``submit`` queues a ``PrefillRequest`` and returns the load (outstanding prefill
tokens) so routers can balance. The loop thread admits requests, steps the engine, and releases
source pages as transfers complete. No Triton import: the ``prefill`` Triton model is a shim.

Per request: submit (validated at once) ──inbox──> PrefillLink.submit ──steps──> prefilled
──every write completed──> source pages released, ``on_done(outcome, seconds)``
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kv_messenger.prefill_side import PrefillOutcome, PrefillSide
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from kv_messenger.transport.base import Transport
from serving.kv_links import PrefillLink, engine_layout, metadata_bytes
from serving.loop import LoopReport, ReportHook, ServingLoop
from serving.registry import Membership, MembershipChange
from serving.tp_group import GroupChannel, GroupPrefillSide
from serving.trace import Tracer
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason
from torch_engine.sampling import InvalidRequestError

log = logging.getLogger(__name__)

DoneHook = Callable[[PrefillOutcome, float], None]  # (outcome, seconds from submit to last write done)


class PrefillLoop(ServingLoop[PrefillRequest]):
    name = "prefill-loop"

    def __init__(
        self,
        engine: LLMEngine,
        side: GroupPrefillSide,
        idle_wait_s: float = 0.002,
        on_done: DoneHook | None = None,
        on_exit: Callable[[], None] | None = None,
        tracer: Tracer | None = None,
        on_report: ReportHook | None = None,
        membership: Membership | None = None,
        stall_s: float | None = None,
    ) -> None:
        super().__init__(on_exit, on_report, stall_s)
        self.engine = engine
        self.membership = membership  # decode groups coming back (a deployment's registry): connect them
        self.on_done = on_done
        self.tracer = tracer
        self.side = side
        self.link = PrefillLink(engine, self.side)
        self.idle_wait_s = idle_wait_s
        self._started: dict[str, float] = {}
        self._outstanding: dict[str, int] = {}
        self.refused = 0  # requests refused after the call was accepted
        self._lock = threading.Lock()
        self.side.start()
        self._start()

    @classmethod
    def standalone(
        cls,
        engine: LLMEngine,
        transport: Transport,
        on_done: DoneHook | None = None,
        on_report: ReportHook | None = None,
        stall_s: float | None = None,
    ) -> PrefillLoop:
        """A TP-1 prefill node whose decode peers connect by ``handshake``."""
        kv = engine.kv_export()
        local = PrefillSide(transport, engine_layout(kv), kv.pools, kv.progress, metadata_bytes(kv))
        side = GroupPrefillSide(local, GroupChannel(engine))
        return cls(engine, side, on_done=on_done, on_report=on_report, stall_s=stall_s)

    def handshake(self, decode_ranks: list[RankEndpoint]) -> RankEndpoint:
        self.side.connect(decode_ranks)
        return self.side.endpoint()

    def submit(self, req: PrefillRequest) -> int:
        """Queue a prefill; returns the outstanding prefill tokens on this node, this one included.
        A prompt the engine would refuse raises ``ValueError`` here, before anything is queued."""
        if len(req.prompt_ids) < 2:
            raise ValueError(f"request {req.request_id}: a split request needs at least 2 prompt tokens")
        try:
            self.engine.check_prompt(req.prompt_ids)
        except InvalidRequestError as exc:
            raise ValueError(f"request {req.request_id}: {exc}") from None
        with self._lock:
            self._outstanding[req.request_id] = len(req.prompt_ids) - 1
            self._started[req.request_id] = time.monotonic()
            load = sum(self._outstanding.values())
        if self.tracer is not None:
            self.tracer.mark(req.request_id, "received", prompt_tokens=len(req.prompt_ids))
        self._put(req)
        return load

    def stop(self, timeout_s: float = 5.0) -> bool:
        stopped = super().stop(timeout_s)
        self.side.stop()
        return stopped

    def live(self) -> int:
        """Requests the loop still tracks (tests of bounded state)."""
        with self._lock:
            return len(self._outstanding)

    def report(self) -> LoopReport:
        waiting, running = self.engine.queue_depths()
        with self._lock:
            records = {"outstanding": len(self._outstanding), "started": len(self._started)}
        records |= {"engine": self.engine.num_requests(), "sources": self.link.live()}
        records |= {"messenger": self.side.jobs(), "tombstones": self.side.tombstones()}
        return LoopReport(self.engine.page_stats(), waiting, running, records, cache=self.engine.cache_stats())

    # -- ServingLoop ---------------------------------------------------------------------
    def _admit(self, item: PrefillRequest) -> None:
        if self.membership is not None and not self.side.connected(item.decode_ranks):
            self._join(self.membership.poll(force=True))  # a decode group that just came back: look now
        try:
            self.link.submit(item)
        except InvalidRequestError as exc:  # refused after the call was accepted: the decoder hears why, now
            aborted = self.side.was_aborted(item.request_id, item.epoch)  # a client that went away: normal
            level = logging.INFO if aborted else logging.WARNING
            log.log(level, "prefill request %s epoch %d refused: %s", item.request_id, item.epoch, exc)
            self.side.refuse(item, str(exc))
            with self._lock:
                self._outstanding.pop(item.request_id, None)
                self._started.pop(item.request_id, None)
            self.refused += 1

    def _join(self, change: MembershipChange | None) -> None:
        """Connect decode groups that came up (a restart: new agents) on every rank of this group."""
        for record in change.joined if change is not None else []:
            log.info("decode group %d is up (generation %d): connecting", record.group, record.generation)
            self.side.connect(record.endpoints)  # followers: the next tick carries it, before any request

    def _busy(self) -> bool:
        return self.engine.has_unfinished()

    def _wait_s(self) -> float:
        return self.idle_wait_s

    def _work(self) -> None:
        if self.side.failure is not None:  # nothing would be sent any more: end (the group restarts)
            raise RuntimeError(self.side.failure)
        self._join(self.membership.poll() if self.membership is not None else None)
        if self.engine.has_unfinished():
            self._stepped = True
            for out in self.link.step():
                if self.tracer is not None and out.finish_reason is FinishReason.PREFILLED:
                    self.tracer.mark(out.request_id, "prefilled", prefill_cached_tokens=out.cached_tokens)
        else:
            self.side.sync()  # TP followers: collect their completions, or a heartbeat
        for outcome in self.link.poll():
            with self._lock:
                self._outstanding.pop(outcome.request_id, None)
                started = self._started.pop(outcome.request_id, time.monotonic())
            if self.tracer is not None:
                self.tracer.close(
                    outcome.request_id, "kv_sent", kv_bytes=outcome.bytes_posted, state=outcome.state.name
                )
            if self.on_done is not None:
                self.on_done(outcome, time.monotonic() - started)

"""A prefill node's serving loop: the engine plus its messenger, driven from one thread.

``PrefillServer`` owns an ``LLMEngine`` (prefill role), a ``PrefillSide`` and the
``PrefillLink`` between them. ``handshake`` connects decode ranks and returns this node's
endpoint; ``submit`` queues a ``PrefillRequest`` and returns the load (outstanding prefill
tokens) so routers can balance. The loop thread admits requests, steps the engine, and releases
source pages as transfers complete. No Triton import: the ``prefill`` Triton model is a shim.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kv_messenger.engine_link import PrefillLink, engine_layout, metadata_bytes
from kv_messenger.prefill_side import PrefillOutcome, PrefillSide
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from kv_messenger.tp_group import GroupChannel, GroupPrefillSide
from kv_messenger.trace import Tracer
from kv_messenger.transport.base import Transport
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason
from torch_engine.sampling import InvalidRequestError

log = logging.getLogger(__name__)

DoneHook = Callable[[PrefillOutcome, float], None]  # (outcome, seconds from submit to last write done)


class PrefillServer:
    def __init__(
        self,
        engine: LLMEngine,
        side: GroupPrefillSide,
        idle_wait_s: float = 0.002,
        on_done: DoneHook | None = None,
        on_exit: Callable[[], None] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.engine = engine
        self.on_done = on_done
        self.on_exit = on_exit
        self.tracer = tracer
        self._started: dict[str, float] = {}
        self.side = side
        self.link = PrefillLink(engine, self.side)
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue[PrefillRequest] = queue.Queue()
        self._outstanding: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.side.start()
        self._thread = threading.Thread(target=self._run, name="prefill-loop", daemon=True)
        self._thread.start()

    @classmethod
    def standalone(cls, engine: LLMEngine, transport: Transport, on_done: DoneHook | None = None) -> PrefillServer:
        """A TP-1 prefill node whose decode peers connect by ``handshake``."""
        local = PrefillSide(transport, engine_layout(engine), engine.kv.pools, engine.progress, metadata_bytes(engine))
        return cls(engine, GroupPrefillSide(local, GroupChannel(engine)), on_done=on_done)

    def handshake(self, decode_ranks: list[RankEndpoint]) -> RankEndpoint:
        self.side.connect(decode_ranks)
        return self.side.endpoint()

    def submit(self, req: PrefillRequest) -> int:
        """Queue a prefill; returns the outstanding prefill tokens on this node, this one included."""
        if len(req.prompt_ids) < 2:
            raise ValueError(f"request {req.request_id}: a split request needs at least 2 prompt tokens")
        if len(req.prompt_ids) >= self.engine.max_model_len:
            raise ValueError(f"request {req.request_id}: {len(req.prompt_ids)} tokens exceed the context")
        vocab = self.engine.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise ValueError(f"request {req.request_id}: a token id is outside the vocabulary [0, {vocab})")
        with self._lock:
            self._outstanding[req.request_id] = len(req.prompt_ids) - 1
            self._started[req.request_id] = time.monotonic()
            load = sum(self._outstanding.values())
        if self.tracer is not None:
            self.tracer.mark(req.request_id, "received", prompt_tokens=len(req.prompt_ids))
        self._inbox.put(req)
        return load

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.side.stop()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._pass()
        finally:
            if self.on_exit is not None:
                self.on_exit()

    def _pass(self) -> None:
        try:
            while True:
                req = self._inbox.get(block=not self.engine.has_unfinished(), timeout=self.idle_wait_s)
                try:
                    self.link.submit(req)
                except InvalidRequestError:
                    log.exception("prefill request %s refused by the engine", req.request_id)
                    with self._lock:
                        self._outstanding.pop(req.request_id, None)
                        self._started.pop(req.request_id, None)
        except queue.Empty:
            pass
        if self.engine.has_unfinished():
            for out in self.link.step():
                if self.tracer is not None and out.finish_reason is FinishReason.PREFILLED:
                    self.tracer.mark(out.request_id, "prefilled")
        else:
            self.side.sync()  # TP followers: collect their completions, or a heartbeat
        for outcome in self.link.reap():
            with self._lock:
                self._outstanding.pop(outcome.request_id, None)
                started = self._started.pop(outcome.request_id, time.monotonic())
            if self.tracer is not None:
                self.tracer.finish(outcome.request_id, "kv_sent", kv_bytes=outcome.bytes_posted)
            if self.on_done is not None:
                self.on_done(outcome, time.monotonic() - started)

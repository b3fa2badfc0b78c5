"""``DecodeLoop``: a decode (or colocated) node's engine on its own thread (a ``ServingLoop``).

``submit`` and ``cancel`` are thread-safe and return at once; the loop thread admits new
requests, runs ``step()``, and hands each ``RequestOutput`` (text delta included) to the
request's callback. A request the engine refuses gets its error through the same callback.

A ``KVSource`` (a decode node of a disaggregated deployment) takes over admission: it reserves
pages and has the KV prefilled elsewhere; the loop polls it every pass (``tick``) and delivers
the failures it reports. ``on_exit`` runs on the loop thread when it ends (TP groups release
their followers there: collectives belong to this thread).

Per request: inbox ──admit──> engine (or KVSource) ──steps──> callback(delta)* ──finished──> callback(final)

Overload is shed, not absorbed: a request is *pending* from ``submit`` until its first output
(in the inbox, the engine's waiting queue, or the KVSource's reservations and transfers). With
``max_pending`` requests pending a new one is refused at once, and a request still pending
``first_token_s`` after its submission is aborted; both errors start with ``OVERLOADED`` (routers
answer them 503 + Retry-After, or try another group), so that a node under 3x its capacity keeps
its latency bounded and its memory flat instead of queueing without end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from serving.loop import LoopReport, ReportHook, ServingLoop
from serving.names import OVERLOADED
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]


def _failed(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, finished=True, finish_reason=FinishReason.ERROR, error=error)


class KVSource(Protocol):
    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Take the request: it prefills it here or elsewhere (raises InvalidRequestError)."""
        ...

    def tick(self) -> list[tuple[str, str]]:
        """Progress; returns the requests that failed since the last tick, with their errors."""
        ...

    def busy(self) -> bool: ...

    def cancel(self, request_id: str) -> bool:
        """Abort a request it holds (True), or say it holds none by that id (False)."""
        ...

    def records(self) -> dict[str, int]:
        """Per-request records it holds, by structure."""
        ...

    def prefill_counts(self) -> tuple[int, int]:
        """Prompts prefilled so far: (on this engine, at a prefill group)."""
        ...


@dataclass(frozen=True, slots=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    chat: bool
    callback: Callback
    at: float = field(default_factory=time.monotonic)


class DecodeLoop(ServingLoop[_Submit | _Cancel]):
    name = "engine-loop"

    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.005,
        on_report: ReportHook | None = None,
        kv: KVSource | None = None,
        on_exit: Callable[[], None] | None = None,
        kv_poll_s: float = 0.0005,
        heartbeat: Callable[[], None] | None = None,
        max_pending: int | None = None,
        first_token_s: float | None = None,
        stall_s: float | None = None,
    ) -> None:
        super().__init__(on_exit, on_report, stall_s)
        self.engine = engine
        self.max_pending, self.first_token_s = max_pending, first_token_s
        self._pending = 0  # submitted, no output yet (under ``_pending_lock``: ``submit`` runs on any thread)
        self._pending_lock = threading.Lock()
        self._first: dict[str, float] = {}  # loop thread: admitted requests without an output -> submitted at
        self._expiry_check = 0.0
        self.heartbeat = heartbeat  # colocated TP leaders: keep idle followers' collectives within their timeout
        self.kv = kv
        self.idle_wait_s = idle_wait_s
        self.kv_poll_s = kv_poll_s
        self._callbacks: dict[str, Callback] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._cache_seq = 0  # the engine's last prefix-cache event handed to a report
        self._start()

    def submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, callback: Callback, chat: bool = False
    ) -> None:
        """Queue a request (any thread). Its guide is compiled here, on the caller's thread: the loop
        only copies it (a big schema can take 100 ms or more to compile)."""
        if params.guide is not None:
            try:
                self.engine.prepare_guide(params.guide)
            except InvalidRequestError as exc:
                self._call(callback, _failed(request_id, str(exc)))
                return
        with self._pending_lock:
            full = self.max_pending is not None and self._pending >= self.max_pending
            if not full:
                self._pending += 1
        if full:
            shed = f"{OVERLOADED}{self.max_pending} requests are waiting for their first token here (max_pending)"
            self._call(callback, _failed(request_id, shed))
            return
        self._put(_Submit(request_id, prompt, params, chat, callback))

    def pending(self) -> int:
        """Requests submitted that have no output yet."""
        return self._pending

    def cancel(self, request_id: str) -> None:
        self._put(_Cancel(request_id))

    def live(self) -> int:
        """Requests the loop still delivers to (tests of bounded state)."""
        return len(self._callbacks)

    # -- ServingLoop ---------------------------------------------------------------------
    def _admit(self, item: _Submit | _Cancel) -> None:
        if isinstance(item, _Cancel):
            rid = item.request_id
            held = self.kv is not None and self.kv.cancel(rid)
            if held or self.engine.abort(rid):
                self._finish(rid, RequestOutput(request_id=rid, finished=True, finish_reason=FinishReason.ABORT))
                self._stepped = True  # pages changed: report now
            return
        self._first[item.request_id] = item.at
        try:
            if self.kv is not None and isinstance(item.prompt, list):
                self.kv.admit(item.request_id, item.prompt, item.params)
            else:
                self.engine.add_request(item.prompt, item.params, request_id=item.request_id, chat=item.chat)
        except InvalidRequestError as exc:
            self._call(item.callback, _failed(item.request_id, str(exc)))
            return
        self._callbacks[item.request_id] = item.callback
        if self.engine.tokenizer is not None:
            self._detok[item.request_id] = IncrementalDetokenizer(self.engine.tokenizer)

    def _busy(self) -> bool:
        return self.engine.has_unfinished()

    def _wait_s(self) -> float:
        return self.kv_poll_s if self.kv is not None and self.kv.busy() else self.idle_wait_s

    def _fail_all(self, error: str) -> None:
        for rid in list(self._callbacks):
            self._finish(rid, _failed(rid, error))

    def _expire(self) -> None:
        """Abort the requests still without an output ``first_token_s`` after they were submitted."""
        now = time.monotonic()
        if self.first_token_s is None or now - self._expiry_check < 0.1:
            return
        self._expiry_check = now
        late = [rid for rid, at in self._first.items() if now - at > self.first_token_s]
        for rid in late:
            if not (self.kv is not None and self.kv.cancel(rid)):
                self.engine.abort(rid)
            error = f"{OVERLOADED}no first token within {self.first_token_s:g} s (first_token_s)"
            self._finish(rid, _failed(rid, error))
            self._stepped = True

    def _work(self) -> None:
        self._expire()
        if self.kv is not None:
            for rid, error in self.kv.tick():
                self._finish(rid, _failed(rid, error))
        if self.engine.has_unfinished():
            for out in self.engine.step():
                try:
                    delta = self._with_text(out)
                except Exception as exc:  # the tokenizer's own error types: this request fails, the others go on
                    log.warning("request %s: detokenising failed: %s", out.request_id, exc)
                    error = f"detokenising failed: {exc}"
                    delta = _failed(out.request_id, error)
                if delta.finished:
                    self._finish(out.request_id, delta)
                else:
                    self._call(self._callbacks[out.request_id], delta)
            self._stepped = True
        elif self.heartbeat is not None:
            self.heartbeat()

    def report(self) -> LoopReport:
        waiting, running = self.engine.queue_depths()
        records = {"callbacks": len(self._callbacks), "detokenizers": len(self._detok)}
        records["engine"] = self.engine.num_requests()
        prefills = (0, 0)
        if self.kv is not None:
            records |= self.kv.records()
            prefills = self.kv.prefill_counts()
        spec = self.engine.spec_stats
        drafts = (spec.proposed, spec.accepted)
        events = self.engine.cache_events(self._cache_seq)
        self._cache_seq = events.seq
        return LoopReport(
            self.engine.page_stats(), waiting, running, records, drafts, prefills, self.engine.cache_stats(), events
        )

    def _with_text(self, out: RequestOutput) -> RequestOutput:
        """Adds the new text (never a split UTF-8 character; a matched stop string cut) and the
        token window it was decoded from, for servers that detokenise in a separate step."""
        detok = self._detok.get(out.request_id)
        if detok is None:
            return out
        window, skip = detok.window()
        before = len(detok.text)
        detok.push(out.new_token_ids)
        req = self.engine.request(out.request_id) if out.finished and self.engine.has_request(out.request_id) else None
        full = req.text if req is not None and req.params.stop else detok.text
        return replace(out, text=full[before:], text_window=(*window, *out.new_token_ids), text_skip=skip)

    def _finish(self, request_id: str, out: RequestOutput) -> None:
        callback = self._callbacks.pop(request_id, None)
        self._detok.pop(request_id, None)
        self.engine.retire(request_id)
        if callback is not None:
            self._call(callback, out)

    def _call(self, callback: Callback, out: RequestOutput) -> None:
        """A failing callback (a client that went away mid-send) must not stop the loop for everyone."""
        if self._first.pop(out.request_id, None) is not None:
            with self._pending_lock:
                self._pending -= 1
        try:
            callback(out)
        except Exception:
            log.exception("delivering output of request %s failed; aborting it", out.request_id)
            if not out.finished:
                self._callbacks.pop(out.request_id, None)
                self._detok.pop(out.request_id, None)
                self.engine.retire(out.request_id)

"""``DecodeLoop``: a decode (or colocated) node's engine on its own thread (a ``ServingLoop``).

``submit`` and ``cancel`` are thread-safe and return at once; the loop thread admits new
requests, runs ``step()``, and hands each ``RequestOutput`` (text delta included) to the
request's callback. A request the engine refuses gets its error through the same callback.

A ``KVSource`` (a decode node of a disaggregated deployment) takes over admission: it reserves
pages and has the KV prefilled elsewhere; the loop polls it every pass (``tick``) and delivers
the failures it reports. ``on_exit`` runs on the loop thread when it ends (TP groups release
their followers there: collectives belong to this thread).

Per request: inbox ──admit──> engine (or KVSource) ──steps──> callback(delta)* ──finished──> callback(final)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from serving.loop import LoopReport, ReportHook, ServingLoop
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]


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
    ) -> None:
        super().__init__(on_exit, on_report)
        self.engine = engine
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
                error = RequestOutput(
                    request_id=request_id, finished=True, finish_reason=FinishReason.ERROR, error=str(exc)
                )
                self._call(callback, error)
                return
        self._put(_Submit(request_id, prompt, params, chat, callback))

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
        try:
            if self.kv is not None and isinstance(item.prompt, list):
                self.kv.admit(item.request_id, item.prompt, item.params)
            else:
                self.engine.add_request(item.prompt, item.params, request_id=item.request_id, chat=item.chat)
        except InvalidRequestError as exc:
            error = RequestOutput(
                request_id=item.request_id, finished=True, finish_reason=FinishReason.ERROR, error=str(exc)
            )
            self._call(item.callback, error)
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
            self._finish(
                rid, RequestOutput(request_id=rid, finished=True, finish_reason=FinishReason.ERROR, error=error)
            )

    def _work(self) -> None:
        if self.kv is not None:
            for rid, error in self.kv.tick():
                self._finish(
                    rid, RequestOutput(request_id=rid, finished=True, finish_reason=FinishReason.ERROR, error=error)
                )
        if self.engine.has_unfinished():
            for out in self.engine.step():
                try:
                    delta = self._with_text(out)
                except Exception as exc:  # the tokenizer's own error types: this request fails, the others go on
                    log.warning("request %s: detokenising failed: %s", out.request_id, exc)
                    error = f"detokenising failed: {exc}"
                    delta = RequestOutput(
                        request_id=out.request_id, finished=True, finish_reason=FinishReason.ERROR, error=error
                    )
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
        try:
            callback(out)
        except Exception:
            log.exception("delivering output of request %s failed; aborting it", out.request_id)
            if not out.finished:
                self._callbacks.pop(out.request_id, None)
                self._detok.pop(out.request_id, None)
                self.engine.retire(out.request_id)

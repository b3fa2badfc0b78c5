"""``EngineLoop``: the engine on its own thread, for servers (the Triton backend) that must never block.

``submit`` and ``cancel`` are thread-safe and return at once; the loop thread admits new
requests, runs ``step()``, and hands each ``RequestOutput`` (text delta included) to the
request's callback. A request the engine refuses gets its error through the same callback.

A ``KVSource`` (a decode node of a disaggregated deployment) takes over admission: it reserves
pages and has the KV prefilled elsewhere; the loop polls it every pass (``tick``) and delivers
the failures it reports. ``on_exit`` runs on the loop thread when it ends (TP groups release
their followers there: collectives belong to this thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from torch_engine.engine import LLMEngine
from torch_engine.kv_cache import PageStats
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]
StepHook = Callable[[PageStats, int, int], None]  # (pages, waiting requests, running requests)


class KVSource(Protocol):
    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> bool:
        """Take the request (True), or leave it to the engine (False); raises InvalidRequestError."""
        ...

    def tick(self) -> list[tuple[str, str]]:
        """Progress; returns the requests that failed since the last tick, with their errors."""
        ...

    def busy(self) -> bool: ...

    def cancel(self, request_id: str) -> bool:
        """Abort a request it holds (True), or say it holds none by that id (False)."""
        ...


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    chat: bool
    callback: Callback


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.005,
        on_step: StepHook | None = None,
        kv: KVSource | None = None,
        on_exit: Callable[[], None] | None = None,
        kv_poll_s: float = 0.0005,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self.kv = kv
        self.on_exit = on_exit
        self.idle_wait_s = idle_wait_s
        self.kv_poll_s = kv_poll_s
        self._inbox: queue.Queue[_Submit | str] = queue.Queue()
        self._callbacks: dict[str, Callback] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, callback: Callback, chat: bool = False
    ) -> None:
        self._inbox.put(_Submit(request_id, prompt, params, chat, callback))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the loop; False if it did not end in time (it is a daemon thread: the process can exit)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the engine loop did not stop within %.0f s", timeout_s)
            return False
        return True

    def _admit(self, item: _Submit | str) -> None:
        if isinstance(item, str):
            held = self.kv is not None and self.kv.cancel(item)
            if held or self.engine.abort(item):
                self._finish(item, RequestOutput(item, [], [], True, FinishReason.ABORT))
                self._report()
            return
        try:
            split = (
                self.kv is not None
                and isinstance(item.prompt, list)
                and self.kv.admit(item.request_id, item.prompt, item.params)
            )
            if not split:
                self.engine.add_request(item.prompt, item.params, request_id=item.request_id, chat=item.chat)
        except InvalidRequestError as exc:
            self._call(item.callback, RequestOutput(item.request_id, [], [], True, FinishReason.ERROR, str(exc)))
            return
        self._callbacks[item.request_id] = item.callback
        if self.engine.tokenizer is not None:
            self._detok[item.request_id] = IncrementalDetokenizer(self.engine.tokenizer)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._pass()
        except Exception as exc:  # a bug or a dead peer: no request may hang on a loop that is gone
            log.exception("the engine loop stopped")
            for rid in list(self._callbacks):
                self._finish(rid, RequestOutput(rid, [], [], True, FinishReason.ERROR, f"engine loop stopped: {exc}"))
            raise
        finally:
            if self.on_exit is not None:
                self.on_exit()

    def _pass(self) -> None:
        try:
            if self.engine.has_unfinished():
                timeout = None
            else:
                timeout = self.kv_poll_s if self.kv is not None and self.kv.busy() else self.idle_wait_s
            while True:
                self._admit(self._inbox.get(block=timeout is not None, timeout=timeout))
                timeout = None
        except queue.Empty:
            pass
        if self.kv is not None:
            for rid, error in self.kv.tick():
                self._finish(rid, RequestOutput(rid, [], [], True, FinishReason.ERROR, error))
        if self.engine.has_unfinished():
            for out in self.engine.step():
                delta = self._with_text(out)
                if out.finished:
                    self._finish(out.request_id, delta)
                else:
                    self._call(self._callbacks[out.request_id], delta)
            self._report()

    def _report(self) -> None:
        if self.on_step is not None:
            sched = self.engine.scheduler
            self.on_step(self.engine.page_stats(), len(sched.waiting), len(sched.running))

    def _with_text(self, out: RequestOutput) -> RequestOutput:
        """Adds the new text (never a split UTF-8 character; a matched stop string cut) and the
        token window it was decoded from, for servers that detokenise in a separate step."""
        detok = self._detok.get(out.request_id)
        if detok is None:
            return out
        window, skip = detok.window()
        before = len(detok.text)
        detok.push(out.new_token_ids)
        req = self.engine.requests.get(out.request_id)
        full = req.text if out.finished and req is not None and req.params.stop else detok.text
        return replace(out, text=full[before:], text_window=(*window, *out.new_token_ids), text_skip=skip)

    def _finish(self, request_id: str, out: RequestOutput) -> None:
        callback = self._callbacks.pop(request_id, None)
        self._detok.pop(request_id, None)
        self.engine.requests.pop(request_id, None)
        if callback is not None:
            self._call(callback, out)

    def _call(self, callback: Callback, out: RequestOutput) -> None:
        """A failing callback (a client that went away mid-send) must not stop the loop for everyone."""
        try:
            callback(out)
        except Exception:
            log.exception("delivering output of request %s failed; aborting it", out.request_id)
            if not out.finished:
                self.engine.abort(out.request_id)
                self._callbacks.pop(out.request_id, None)
                self._detok.pop(out.request_id, None)
                self.engine.requests.pop(out.request_id, None)

"""``EngineLoop``: the engine on its own thread, for servers (the Triton backend) that must never block.

``submit`` and ``cancel`` are thread-safe and return at once; the loop thread admits new
requests, runs ``step()``, and hands each ``RequestOutput`` (text delta included) to the
request's callback. A request the engine refuses gets its error through the same callback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.tokenizer import IncrementalDetokenizer

Callback = Callable[[RequestOutput], None]


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    chat: bool
    callback: Callback


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.005) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
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

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _admit(self, item: _Submit | str) -> None:
        if isinstance(item, str):
            if self.engine.abort(item):
                self._finish(item, RequestOutput(item, [], [], True, FinishReason.ABORT))
            return
        try:
            self.engine.add_request(item.prompt, item.params, request_id=item.request_id, chat=item.chat)
        except InvalidRequestError as exc:
            item.callback(RequestOutput(item.request_id, [], [], True, FinishReason.ERROR, str(exc)))
            return
        self._callbacks[item.request_id] = item.callback
        if self.engine.tokenizer is not None:
            self._detok[item.request_id] = IncrementalDetokenizer(self.engine.tokenizer)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                timeout = None if self.engine.has_unfinished() else self.idle_wait_s
                while True:
                    self._admit(self._inbox.get(block=timeout is not None, timeout=timeout))
                    timeout = None
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            for out in self.engine.step():
                text = self._text_delta(out)
                delta = RequestOutput(
                    out.request_id, out.new_token_ids, out.output_ids, out.finished, out.finish_reason, out.error, text
                )
                if out.finished:
                    self._finish(out.request_id, delta)
                else:
                    self._callbacks[out.request_id](delta)

    def _text_delta(self, out: RequestOutput) -> str:
        """New text of this output; never splits a UTF-8 character; a matched stop string is cut."""
        detok = self._detok.get(out.request_id)
        if detok is None:
            return ""
        before = len(detok.text)
        detok.push(out.new_token_ids)
        req = self.engine.requests.get(out.request_id)
        full = req.text if out.finished and req is not None and req.params.stop else detok.text
        return full[before:]

    def _finish(self, request_id: str, out: RequestOutput) -> None:
        callback = self._callbacks.pop(request_id, None)
        self._detok.pop(request_id, None)
        self.engine.requests.pop(request_id, None)
        if callback is not None:
            callback(out)

"""Triton Python-based backend ``disagg_backend``: tensors <-> typed requests, nothing else.

In the decode role the engine runs on its own thread (``torch_engine.serving.EngineLoop``);
``execute`` only parses each request and hands it over, so the stub never blocks on one
request, and responses (token windows) go back through each request's decoupled sender.
Preprocessing and postprocessing are plain request -> response conversions. Bad input gets a
per-request error.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from pydantic import ValidationError

from kv_messenger.prefill_side import PrefillOutcome
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from kv_messenger.trace import Tracer
from orchestrator.llm_request import parse_sampling, parse_stop_words, parse_text
from orchestrator.node import decode_loop, prefill_server
from orchestrator.node_config import NodeConfig
from torch_engine.kv_cache import PageStats
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError
from torch_engine.serving import EngineLoop
from torch_engine.tokenizer import Tokenizer, window_text

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    """One class, four roles (the model config's ``role`` parameter): ``preprocessing`` (text ->
    token ids), ``decode`` (token ids -> streamed token windows, decoupled; owns the engine),
    ``postprocessing`` (token window -> text) and ``prefill`` (prefill nodes)."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.role = config["parameters"]["role"]["string_value"]
        self.node = NodeConfig.load(os.environ["DISAGG_NODE_CONFIG"])
        if self.role == "decode":
            self.metrics = _Metrics()
            self.loop, self.tracer = decode_loop(self.node, on_step=self.metrics.step)
        elif self.role == "prefill":
            self.transfers = _TransferMetrics()
            self.prefill = prefill_server(self.node, on_done=self.transfers.done)
        else:
            self.tokenizer = Tokenizer(self.node.engine_dir)

    def execute(self, requests: list) -> list | None:
        if self.role == "decode":
            for request in requests:
                self._decode(request)
            return None
        return [self._convert(request) for request in requests]

    def _convert(self, request: object) -> object:
        get = _getter(request)
        try:
            if self.role == "prefill":
                return self._prefill(get)
            if self.role == "preprocessing":
                prompt, chat = parse_text(get)
                ids = np.array(self.tokenizer.encode(prompt, chat=chat), dtype=np.int32)
                return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("input_ids", ids)])
            window = [int(t) for t in get("output_ids").reshape(-1)]
            text = window_text(self.tokenizer, window, int(get("text_skip").reshape(-1)[0]))
            for stop in parse_stop_words(get):  # a stop string inside this piece ends the text there
                text = text.split(stop, 1)[0]
            return _text_response(text)
        except InvalidRequestError as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))

    def _prefill(self, get) -> object:
        """``handshake``: decode endpoints in, our endpoint out; ``prefill_request``: queue it, return the load."""
        hs, pr = get("handshake"), get("prefill_request")
        try:
            if hs is not None:
                eps = [RankEndpoint.model_validate(e) for e in json.loads(hs.reshape(-1)[0])]
                mine = self.prefill.handshake(eps).model_dump_json()
                return pb_utils.InferenceResponse(output_tensors=[_strings("endpoint", mine)])
            if pr is not None:
                load = self.prefill.submit(PrefillRequest.model_validate_json(pr.reshape(-1)[0]))
                return pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("load_tokens", np.array([load], np.int64))]
                )
        except (ValueError, ValidationError) as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        return pb_utils.InferenceResponse(error=pb_utils.TritonError("send handshake or prefill_request"))

    def _decode(self, request: object) -> None:
        sender = request.get_response_sender()
        get = _getter(request)
        try:
            params, stream = parse_sampling(get, self.node.max_tokens_limit)
        except InvalidRequestError as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
            return
        ids = [int(t) for t in get("input_ids").reshape(-1)]
        rid = f"{request.request_id() or 'triton'}#{id(request)}"
        if self.tracer is not None:
            self.tracer.mark(rid, "arrived", prompt_tokens=len(ids))
        responder = _Responder(sender, stream, self.loop, self.metrics, params.stop, self.tracer)
        self.loop.submit(rid, ids, params, responder)

    def finalize(self) -> None:
        if self.role == "decode":
            self.loop.stop()
        elif self.role == "prefill":
            self.prefill.stop()


def _getter(request: object):
    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


class _Metrics:
    """Prometheus metrics next to Triton's own (served on its metrics port)."""

    def __init__(self) -> None:
        fam = pb_utils.MetricFamily
        buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self._families = [
            fam("disagg_time_to_first_token_seconds", "Time from request arrival to its first token", fam.HISTOGRAM),
            fam("disagg_inter_token_latency_seconds", "Time between consecutive tokens of a request", fam.HISTOGRAM),
            fam("disagg_prompt_tokens_total", "Prompt tokens of finished requests", fam.COUNTER),
            fam("disagg_generation_tokens_total", "Generated tokens", fam.COUNTER),
            fam("disagg_kv_pages", "KV cache pages by state", fam.GAUGE),
            fam("disagg_queue_depth", "Requests waiting / running in the engine", fam.GAUGE),
        ]
        ttft, itl, prompt, gen, pages, queue = self._families
        self.ttft = ttft.Metric(labels={"model": "llm"}, buckets=buckets)
        self.itl = itl.Metric(labels={"model": "llm"}, buckets=buckets)
        self.prompt_tokens = prompt.Metric(labels={"model": "llm"})
        self.generation_tokens = gen.Metric(labels={"model": "llm"})
        self.pages = {s: pages.Metric(labels={"model": "llm", "state": s}) for s in ("free", "used", "pinned")}
        self.queue = {q: queue.Metric(labels={"model": "llm", "queue": q}) for q in ("waiting", "running")}

    def step(self, stats: PageStats, waiting: int, running: int) -> None:
        self.pages["free"].set(stats.free)
        self.pages["used"].set(stats.used)
        self.pages["pinned"].set(stats.pinned)
        self.queue["waiting"].set(waiting)
        self.queue["running"].set(running)


class _TransferMetrics:
    """Prefill nodes: KV bytes sent and the time from a prefill request to its last completed write."""

    def __init__(self) -> None:
        fam = pb_utils.MetricFamily
        buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
        self._families = [
            fam("disagg_kv_transfer_bytes_total", "KV bytes written to decode nodes", fam.COUNTER),
            fam("disagg_kv_transfer_seconds", "Prefill request received -> its last KV write completed", fam.HISTOGRAM),
        ]
        self.bytes = self._families[0].Metric(labels={"model": "prefill"})
        self.seconds = self._families[1].Metric(labels={"model": "prefill"}, buckets=buckets)

    def done(self, outcome: PrefillOutcome, seconds: float) -> None:
        self.bytes.increment(outcome.bytes_posted)
        self.seconds.observe(seconds)


class _Responder:
    """Streams token windows (``stream`` true) or sends all tokens once; aborts on cancellation."""

    def __init__(
        self,
        sender: object,
        stream: bool,
        loop: EngineLoop,
        metrics: _Metrics,
        stop: tuple[str, ...],
        tracer: Tracer | None,
    ) -> None:
        self.sender = sender
        self.tracer = tracer
        self.stop = stop
        self.stream = stream
        self.loop = loop
        self.metrics = metrics
        self.all_ids: list[int] = []
        self.last = time.monotonic()
        self.first = True

    def __call__(self, out: RequestOutput) -> None:
        if self.sender.is_cancelled():  # the client went away: stop, and only close the stream
            if out.finished:
                self.sender.send(flags=FINAL)  # Triton releases the request only once it is closed
            else:
                self.loop.cancel(out.request_id)
            return
        if out.error is not None:
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error)), flags=FINAL)
            return
        if out.finish_reason is FinishReason.ABORT:  # aborted here: close the stream
            self.sender.send(flags=FINAL)
            return
        now = time.monotonic()
        if self.tracer is not None:
            if self.first and out.new_token_ids:
                self.tracer.mark(out.request_id, "first_token")
            if out.finished:
                self.tracer.finish(out.request_id, output_tokens=len(out.output_ids) or len(self.all_ids))
        if out.new_token_ids:
            (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
            self.metrics.generation_tokens.increment(len(out.new_token_ids))
            self.first, self.last = False, now
        if out.finished:
            self.metrics.prompt_tokens.increment(out.prompt_tokens)
        if self.stream:
            if out.text or out.finished:
                response = _window_response(out.text_window, out.text_skip, self.stop)
                self.sender.send(response, flags=FINAL if out.finished else 0)
        else:
            self.all_ids.extend(out.new_token_ids)
            if out.finished:
                self.sender.send(_window_response(tuple(self.all_ids), 0, self.stop), flags=FINAL)


def _window_response(window: tuple[int, ...], skip: int, stop: tuple[str, ...]) -> object:
    tensors = [
        pb_utils.Tensor("output_ids", np.array(window, dtype=np.int32)),
        pb_utils.Tensor("text_skip", np.array([skip], dtype=np.int32)),
    ]
    if stop:
        tensors.append(pb_utils.Tensor("stop_words_out", np.array([s.encode() for s in stop], dtype=np.object_)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _strings(name: str, *values: str) -> object:
    return pb_utils.Tensor(name, np.array([v.encode("utf-8") for v in values], dtype=np.object_))


def _text_response(text: str) -> object:
    return pb_utils.InferenceResponse(output_tensors=[_strings("text_output", text)])

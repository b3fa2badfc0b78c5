"""Triton Python-based backend ``disagg_backend``: tensors <-> typed requests, nothing else.

The engine runs on its own thread (``torch_engine.serving.EngineLoop``); ``execute`` only
parses each request and hands it over, so the stub never blocks on one request. Responses go
back through each request's decoupled response sender. Bad input gets a per-request error.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from orchestrator.llm_request import parse_request
from orchestrator.node_config import NodeConfig
from torch_engine.engine import LLMEngine
from torch_engine.kv_cache import PageStats
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError
from torch_engine.serving import EngineLoop

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.model_config = json.loads(args["model_config"])
        self.node = NodeConfig.load(os.environ["DISAGG_NODE_CONFIG"])
        self.metrics = _Metrics()
        self.loop = EngineLoop(LLMEngine(self.node.engine_config()), on_step=self.metrics.step)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(lambda name, r=request: _input(r, name), self.node.max_tokens_limit)
            except InvalidRequestError as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
                continue
            rid = parsed.request_id or request.request_id() or f"triton-{id(request)}"
            self.loop.submit(
                rid,
                parsed.prompt,
                parsed.params,
                _Responder(sender, parsed.stream, self.loop, self.metrics),
                parsed.chat,
            )

    def finalize(self) -> None:
        self.loop.stop()


def _input(request: object, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


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


class _Responder:
    """Streams text deltas (``stream`` true) or sends the whole text once; aborts on cancellation."""

    def __init__(self, sender: object, stream: bool, loop: EngineLoop, metrics: _Metrics) -> None:
        self.sender = sender
        self.stream = stream
        self.loop = loop
        self.metrics = metrics
        self.text: list[str] = []
        self.last = time.monotonic()
        self.first = True

    def __call__(self, out: RequestOutput) -> None:
        if self.sender.is_cancelled() and not out.finished:
            self.loop.cancel(out.request_id)
            return
        if out.error is not None:
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error)), flags=FINAL)
            return
        if out.finish_reason is FinishReason.ABORT:  # the client went away: just close the stream
            self.sender.send(flags=FINAL)
            return
        now = time.monotonic()
        if out.new_token_ids:
            (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
            self.metrics.generation_tokens.increment(len(out.new_token_ids))
            self.first, self.last = False, now
        if out.finished:
            self.metrics.prompt_tokens.increment(out.prompt_tokens)
        self.text.append(out.text)
        if self.stream and (out.text or out.finished):
            self.sender.send(_response(out.text), flags=FINAL if out.finished else 0)
        elif out.finished:
            self.sender.send(_response("".join(self.text)), flags=FINAL)


def _response(text: str) -> object:
    data = np.array([text.encode("utf-8")], dtype=np.object_)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", data)])

"""Triton Python-based backend ``disagg_backend``: tensors <-> typed requests, nothing else.

The engine runs on its own thread (``torch_engine.serving.EngineLoop``); ``execute`` only
parses each request and hands it over, so the stub never blocks on one request. Responses go
back through each request's decoupled response sender. Bad input gets a per-request error.
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from orchestrator.llm_request import parse_request
from orchestrator.node_config import NodeConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import RequestOutput
from torch_engine.sampling import InvalidRequestError
from torch_engine.serving import EngineLoop

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.model_config = json.loads(args["model_config"])
        self.node = NodeConfig.load(os.environ["DISAGG_NODE_CONFIG"])
        self.loop = EngineLoop(LLMEngine(self.node.engine_config()))

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
                rid, parsed.prompt, parsed.params, _Responder(sender, parsed.stream, self.loop), parsed.chat
            )

    def finalize(self) -> None:
        self.loop.stop()


def _input(request: object, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


class _Responder:
    """Streams text deltas (``stream`` true) or sends the whole text once; aborts on cancellation."""

    def __init__(self, sender: object, stream: bool, loop: EngineLoop) -> None:
        self.sender = sender
        self.stream = stream
        self.loop = loop
        self.text: list[str] = []

    def __call__(self, out: RequestOutput) -> None:
        if self.sender.is_cancelled() and not out.finished:
            self.loop.cancel(out.request_id)
            return
        if out.error is not None:
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error)), flags=FINAL)
            return
        self.text.append(out.text)
        if self.stream and (out.text or out.finished):
            self.sender.send(_response(out.text), flags=FINAL if out.finished else 0)
        elif out.finished:
            self.sender.send(_response("".join(self.text)), flags=FINAL)


def _response(text: str) -> object:
    data = np.array([text.encode("utf-8")], dtype=np.object_)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", data)])

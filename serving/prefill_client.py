"""Prefill calls from a decode leader: async Triton gRPC requests to a prefill group's ``prefill``
model. Replies (the group's load, or the error) arrive on gRPC client threads and are queued for
the engine loop thread; ``Caller`` is the seam tests replace with a fake.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kv_messenger.protocol import PrefillRequest
from serving.names import Model, Tensor


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """A prefill group as a decode leader sees it: where to send requests, which agents write."""

    group: int
    grpc_url: str
    agents: list[str]  # by TP rank


@dataclass(frozen=True, slots=True)
class Reply:
    group: int
    request_id: str
    epoch: int
    load_tokens: int | None
    error: str | None


class PrefillCaller:
    """Async Triton gRPC calls to one prefill group's ``prefill`` model; replies go to a queue."""

    def __init__(self, group: PrefillGroup, timeout_s: float, replies: queue.Queue[Reply]) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.replies = replies
        self.client = grpcclient.InferenceServerClient(group.grpc_url)

    def call(self, req: PrefillRequest) -> None:
        inp = grpcclient.InferInput(Tensor.PREFILL_REQUEST, [1], "BYTES")
        inp.set_data_from_numpy(np.array([req.model_dump_json().encode()], dtype=np.object_))
        out = grpcclient.InferRequestedOutput(Tensor.LOAD_TOKENS)
        done = partial(self._done, req.request_id, req.epoch)
        try:
            self.client.async_infer(Model.PREFILL, [inp], done, outputs=[out], client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            self.replies.put(Reply(self.group.group, req.request_id, req.epoch, None, str(exc)))

    def _done(
        self, request_id: str, epoch: int, result: grpcclient.InferResult, error: InferenceServerException | None
    ) -> None:
        if error is not None:
            self.replies.put(Reply(self.group.group, request_id, epoch, None, str(error)))
            return
        load = result.as_numpy(Tensor.LOAD_TOKENS)
        self.replies.put(Reply(self.group.group, request_id, epoch, int(load.reshape(-1)[0]), None))

    def close(self) -> None:
        self.client.close()


class Caller(Protocol):
    def call(self, req: PrefillRequest) -> None: ...

    def close(self) -> None: ...


CallerFactory = Callable[[PrefillGroup, float, "queue.Queue[Reply]"], Caller]

"""Prefill calls from a decode leader: async Triton gRPC requests to a prefill group's ``prefill``
model. Replies (the group's load, or the error) arrive on gRPC client threads and are queued for
the engine loop thread; ``Caller`` is the seam tests replace with a fake.
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kv_messenger.protocol import PrefillRequest
from serving.codecs import PREFILL, encode_prefill, parse_load
from serving.grpc_channel import sync_client
from serving.names import Model, Tensor
from serving.node_config import GRPC_AUTH_HEADER
from serving.registry import GroupRecord
from serving.wire import client_inputs


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """A prefill group as a decode leader sees it: where to send requests, which agents write."""

    group: int
    grpc_url: str
    agents: list[str]  # by TP rank

    @classmethod
    def of(cls, record: GroupRecord) -> PrefillGroup:
        url = record.leader.grpc_url
        assert url is not None, f"prefill group {record.group} published no gRPC endpoint"
        return cls(record.group, url, record.agents)


class Delivery(enum.IntEnum):
    """What a failed call says about the request (ordered: worse is larger)."""

    REFUSED = 0  # the prefill node's model answered with an error: it did not take this request
    UNREACHED = 1  # no connection was made: the request never left this process
    UNKNOWN = 2  # a timeout or a broken call: the node may have taken it and may still write


@dataclass(frozen=True, slots=True)
class Reply:
    group: int
    request_id: str
    epoch: int
    load_tokens: int | None
    error: str | None
    delivery: Delivery = Delivery.REFUSED  # with an error: may the group still write?


REFUSAL_MARK = "prefill refused: "  # starts every error the prefill model answers itself (nothing was started)


def refusal(message: str) -> str:
    """The prefill model's own refusal, as it answers it (``delivery_of`` tells it from other errors)."""
    return REFUSAL_MARK + message


def delivery_of(exc: InferenceServerException) -> Delivery:
    """Only errors that are the node's own answer, or a connection that was never made, prove the
    request was not taken; anything else may have reached the model. INVALID_ARGUMENT is Triton's
    own check of the inputs (before the model runs); INTERNAL is a refusal only when it carries the
    model's mark: an HTTP/2 reset, a stub that died after taking the request ("Stub process ... is not
    healthy") and other server-side failures are INTERNAL too, and those may have been delivered."""
    status, message = str(exc.status()), exc.message() or ""
    if status == "StatusCode.INVALID_ARGUMENT" or (status == "StatusCode.INTERNAL" and REFUSAL_MARK in message):
        return Delivery.REFUSED
    if status == "StatusCode.NOT_FOUND" or (
        status == "StatusCode.UNAVAILABLE" and "failed to connect" in message.lower()
    ):
        return Delivery.UNREACHED  # no such model there (not loaded), or no connection
    return Delivery.UNKNOWN


class PrefillCaller:
    """Async Triton gRPC calls to one prefill group's ``prefill`` model; replies go to a queue."""

    def __init__(
        self, group: PrefillGroup, timeout_s: float, replies: queue.Queue[Reply], auth_key: str | None = None
    ) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.replies = replies
        self.client = sync_client(group.grpc_url)
        self.headers = {GRPC_AUTH_HEADER: auth_key} if auth_key else None  # prefill nodes restrict inference

    def call(self, req: PrefillRequest) -> None:
        inputs = client_inputs(PREFILL, encode_prefill(req))
        out = grpcclient.InferRequestedOutput(Tensor.LOAD_TOKENS)
        done = partial(self._done, req.request_id, req.epoch)
        try:
            self.client.async_infer(
                Model.PREFILL, inputs, done, outputs=[out], client_timeout=self.timeout_s, headers=self.headers
            )
        except InferenceServerException as exc:  # raised before the call went out
            self.replies.put(Reply(self.group.group, req.request_id, req.epoch, None, str(exc), Delivery.UNREACHED))

    def _done(
        self, request_id: str, epoch: int, result: grpcclient.InferResult, error: InferenceServerException | None
    ) -> None:
        if error is not None:
            self.replies.put(Reply(self.group.group, request_id, epoch, None, str(error), delivery_of(error)))
            return
        self.replies.put(Reply(self.group.group, request_id, epoch, parse_load(result.as_numpy), None))

    def close(self) -> None:
        self.client.close()


class Caller(Protocol):
    def call(self, req: PrefillRequest) -> None: ...

    def close(self) -> None: ...


CallerFactory = Callable[[PrefillGroup, float, "queue.Queue[Reply]"], Caller]

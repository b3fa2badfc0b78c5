"""One request to one decode group's ``decode`` model over Triton gRPC streaming: token ids in,
token windows out (the same windows the ``llm`` ensemble's postprocessing decodes).

Failures are reported as three exceptions: ``GroupUnavailable`` (the transport failed: the group is
down or unreachable; the router takes it out of rotation and may retry elsewhere), ``Overloaded``
(the group shed the request: too many waiting there, or no first token in time; another group
may take it) and ``Refused`` (the group answered with an error for this request: bad input, or
its own failure).
Closing the iterator cancels the call, so the decode node aborts the request and frees its pages.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping

import grpc
import numpy as np
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import InferenceServerException, InferRequestedOutput

from serving.codecs import (
    DECODE,
    DecodeCall,
    DecodePiece,
    encode_decode,
    encode_events_query,
    parse_events,
    parse_piece,
)
from serving.kv_events import KVEventBatch, KVEventsQuery
from serving.names import OVERLOADED, Model, Tensor
from serving.wire import client_inputs
from torch_engine.sampling import InvalidRequestError, SamplingParams


class GroupUnavailable(RuntimeError):
    """The group could not be reached, or its stream broke."""


class Refused(RuntimeError):
    """The group answered this request with an error."""


class Overloaded(Refused):
    """The group shed this request (its error starts with ``OVERLOADED``)."""


Piece = DecodePiece  # one streamed response of ``decode`` (its codec: ``serving.codecs``)
OUTPUTS = (Tensor.OUTPUT_IDS, Tensor.TEXT_SKIP, Tensor.SEQUENCE_LENGTH, Tensor.CACHED_TOKENS, Tensor.FINISH_REASON)
LOGPROB_OUTPUTS = (Tensor.OUTPUT_LOG_PROBS, Tensor.TOP_LOGPROB_IDS, Tensor.TOP_LOGPROB_VALUES)
PROMPT_OUTPUTS = (Tensor.PROMPT_LOG_PROBS, Tensor.PROMPT_TOP_IDS, Tensor.PROMPT_TOP_VALUES)


async def _one(request: Mapping[str, object]) -> AsyncIterator[Mapping[str, object]]:
    yield request


def _piece(result: object, k: int | None, prompt_k: int | None) -> Piece:
    def get(name: str) -> np.ndarray | None:
        return result.as_numpy(name)  # type: ignore[attr-defined]

    try:
        return parse_piece(get, k, prompt_k)
    except InvalidRequestError as exc:
        raise Refused(f"the decode model's response: {exc}") from None


Headers = Mapping[str, str] | None  # the deployment's key, where decode nodes restrict inference


async def _results(
    client: aioclient.InferenceServerClient, request: Mapping[str, object], timeout_s: float, headers: Headers
) -> AsyncGenerator[object, None]:
    """The responses of one call to ``decode``: a transport failure is ``GroupUnavailable``, an error
    the group answered ``Refused``; closing the generator cancels the call."""
    try:
        responses = client.stream_infer(_one(request), stream_timeout=timeout_s, headers=headers)
    except InferenceServerException as exc:
        raise GroupUnavailable(str(exc)) from None
    try:
        async for result, error in responses:
            if error is not None:
                message = str(error.message() or error)
                raise (Overloaded if OVERLOADED in message else Refused)(message)
            yield result
    except grpc.aio.AioRpcError as exc:
        raise GroupUnavailable(f"{exc.code().name}: {exc.details()}") from None
    finally:
        responses.cancel()


async def stream(
    client: aioclient.InferenceServerClient,
    ids: list[int],
    s: SamplingParams,
    request_id: str,
    timeout_s: float,
    headers: Headers = None,
) -> AsyncGenerator[Piece, None]:
    outputs = OUTPUTS + (LOGPROB_OUTPUTS if s.logprobs is not None else ())
    outputs += PROMPT_OUTPUTS if s.prompt_logprobs is not None else ()
    request = {
        "model_name": Model.DECODE.value,
        "inputs": client_inputs(DECODE, encode_decode(DecodeCall(ids, s, stream=True))),
        "outputs": [InferRequestedOutput(name) for name in outputs],
        "request_id": request_id,
    }
    async with contextlib.aclosing(_results(client, request, timeout_s, headers)) as results:
        async for result in results:
            piece = _piece(result, s.logprobs, s.prompt_logprobs)
            yield piece
            if piece.finish_reason:
                return
    raise GroupUnavailable("the stream ended before the last token")


async def events(
    client: aioclient.InferenceServerClient, query: KVEventsQuery, timeout_s: float, headers: Headers = None
) -> KVEventBatch:
    """The group's prefix-cache events after ``query`` (``serving.kv_events``): one control call."""
    request = {
        "model_name": Model.DECODE.value,
        "inputs": client_inputs(DECODE, encode_events_query(query)),
        "outputs": [InferRequestedOutput(Tensor.KV_EVENTS.value)],
    }
    async with contextlib.aclosing(_results(client, request, timeout_s, headers)) as results:
        async for result in results:
            try:
                return parse_events(result.as_numpy)  # type: ignore[attr-defined]
            except InvalidRequestError as exc:
                raise Refused(f"the decode model's events: {exc}") from None
    raise GroupUnavailable("the events call ended without a response")

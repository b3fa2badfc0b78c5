"""One request to one decode group's ``decode`` model over Triton gRPC streaming: token ids in,
token windows out (the same windows the ``llm`` ensemble's postprocessing decodes).

Failures are reported as two exceptions: ``GroupUnavailable`` (the transport failed: the group is
down or unreachable; the router takes it out of rotation and may retry elsewhere) and
``Refused`` (the group answered with an error for this request: bad input, or its own failure).
Closing the iterator cancels the call, so the decode node aborts the request and frees its pages.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import InferenceServerException, InferInput, InferRequestedOutput

from serving.names import Model, Tensor


class GroupUnavailable(RuntimeError):
    """The group could not be reached, or its stream broke."""


class Refused(RuntimeError):
    """The group answered this request with an error."""


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int | None = None  # None: no log-probabilities


@dataclass(frozen=True, slots=True)
class Piece:
    """One streamed response: ``window`` decodes, past its first ``skip`` tokens, to the new text."""

    window: tuple[int, ...]
    skip: int
    generated: int  # tokens generated so far (the new ones are the window's last tokens)
    finish_reason: str  # "" until the last piece: "stop" or "length"
    logprobs: tuple[float, ...] = ()  # of the new tokens
    top_ids: tuple[tuple[int, ...], ...] = ()  # per new token, its top alternatives
    top_logprobs: tuple[tuple[float, ...], ...] = ()


def _tensor(name: str, value: np.ndarray, dtype: str) -> InferInput:
    t = InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def decode_inputs(ids: list[int], s: Sampling) -> list[InferInput]:
    inputs = [
        _tensor(Tensor.INPUT_IDS, np.array(ids, dtype=np.int32), "INT32"),
        _tensor(Tensor.MAX_TOKENS, np.array([s.max_tokens], dtype=np.int32), "INT32"),
        _tensor(Tensor.STREAM, np.array([True]), "BOOL"),
        _tensor(Tensor.TEMPERATURE, np.array([s.temperature], dtype=np.float32), "FP32"),
        _tensor(Tensor.TOP_P, np.array([s.top_p], dtype=np.float32), "FP32"),
        _tensor(Tensor.TOP_K, np.array([s.top_k], dtype=np.int32), "INT32"),
        _tensor(Tensor.IGNORE_EOS, np.array([s.ignore_eos]), "BOOL"),
        _tensor(Tensor.REPETITION_PENALTY, np.array([s.repetition_penalty], dtype=np.float32), "FP32"),
        _tensor(Tensor.PRESENCE_PENALTY, np.array([s.presence_penalty], dtype=np.float32), "FP32"),
        _tensor(Tensor.FREQUENCY_PENALTY, np.array([s.frequency_penalty], dtype=np.float32), "FP32"),
    ]
    if s.seed is not None:
        inputs.append(_tensor(Tensor.RANDOM_SEED, np.array([s.seed], dtype=np.uint64), "UINT64"))
    if s.stop:
        inputs.append(_tensor(Tensor.STOP_WORDS, np.array([x.encode() for x in s.stop], dtype=np.object_), "BYTES"))
    if s.top_logprobs is not None:
        inputs.append(_tensor(Tensor.RETURN_LOG_PROBS, np.array([True]), "BOOL"))
        inputs.append(_tensor(Tensor.TOP_LOGPROBS, np.array([s.top_logprobs], dtype=np.int32), "INT32"))
    return inputs


OUTPUTS = (Tensor.OUTPUT_IDS, Tensor.TEXT_SKIP, Tensor.SEQUENCE_LENGTH, Tensor.FINISH_REASON)
LOGPROB_OUTPUTS = (Tensor.OUTPUT_LOG_PROBS, Tensor.TOP_LOGPROB_IDS, Tensor.TOP_LOGPROB_VALUES)


async def _one(request: Mapping[str, object]) -> AsyncIterator[Mapping[str, object]]:
    yield request


def _piece(result: object, k: int | None) -> Piece:
    def get(name: str) -> np.ndarray:
        value = result.as_numpy(name)  # type: ignore[attr-defined]
        if value is None:
            raise Refused(f"the decode model's response has no {name}")
        return value

    reason = get(Tensor.FINISH_REASON).reshape(-1)[0]
    piece = Piece(
        window=tuple(int(t) for t in get(Tensor.OUTPUT_IDS).reshape(-1)),
        skip=int(get(Tensor.TEXT_SKIP).reshape(-1)[0]),
        generated=int(get(Tensor.SEQUENCE_LENGTH).reshape(-1)[0]),
        finish_reason=reason.decode() if isinstance(reason, bytes) else str(reason),
    )
    if k is None:
        return piece
    values = get(Tensor.OUTPUT_LOG_PROBS).reshape(-1)
    top_ids, top_values = get(Tensor.TOP_LOGPROB_IDS), get(Tensor.TOP_LOGPROB_VALUES)
    n = values.size
    top_ids, top_values = top_ids.reshape(n, -1)[:, :k], top_values.reshape(n, -1)[:, :k]
    return Piece(
        piece.window, piece.skip, piece.generated, piece.finish_reason,
        tuple(float(v) for v in values),
        tuple(tuple(int(t) for t in row) for row in top_ids),
        tuple(tuple(float(v) for v in row) for row in top_values),
    )  # fmt: skip


async def stream(
    client: aioclient.InferenceServerClient, ids: list[int], s: Sampling, request_id: str, timeout_s: float
) -> AsyncGenerator[Piece, None]:
    outputs = OUTPUTS + (LOGPROB_OUTPUTS if s.top_logprobs is not None else ())
    request = {
        "model_name": Model.DECODE.value,
        "inputs": decode_inputs(ids, s),
        "outputs": [InferRequestedOutput(name) for name in outputs],
        "request_id": request_id,
    }
    try:
        responses = client.stream_infer(_one(request), stream_timeout=timeout_s)
    except InferenceServerException as exc:
        raise GroupUnavailable(str(exc)) from None
    try:
        async for result, error in responses:
            if error is not None:
                raise Refused(str(error.message() or error))
            piece = _piece(result, s.top_logprobs)
            yield piece
            if piece.finish_reason:
                return
        raise GroupUnavailable("the stream ended before the last token")
    except grpc.aio.AioRpcError as exc:
        raise GroupUnavailable(f"{exc.code().name}: {exc.details()}") from None
    finally:
        responses.cancel()

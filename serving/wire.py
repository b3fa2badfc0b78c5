"""The Triton wire contract, declared once: every model's inputs and outputs with names, types and
dims (``SIGNATURES``; ``model_repo/*/config.pbtxt`` is checked against it), how a value becomes the
declared array (``array``) and how a received array is read back as a typed value (``Reader``).

The per-model codecs (``serving/codecs.py``) build on this; callers (the router, the client, the
prefill client) and the backend use the codecs, so a tensor's type is written down here only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from serving.names import Model, Tensor
from torch_engine.sampling import InvalidRequestError

Getter = Callable[[str], "np.ndarray | None"]
Arrays = dict[Tensor, np.ndarray]


class WireType(enum.StrEnum):
    """Triton's data types (the client's names); ``config`` is the model configuration's."""

    BOOL = "BOOL"
    INT32 = "INT32"
    INT64 = "INT64"
    UINT64 = "UINT64"
    FP32 = "FP32"
    BYTES = "BYTES"

    @property
    def config(self) -> str:
        return "TYPE_STRING" if self is WireType.BYTES else f"TYPE_{self.value}"

    @property
    def numpy(self) -> type[np.generic]:
        return _NUMPY[self]


_NUMPY: dict[WireType, type[np.generic]] = {
    WireType.BOOL: np.bool_,
    WireType.INT32: np.int32,
    WireType.INT64: np.int64,
    WireType.UINT64: np.uint64,
    WireType.FP32: np.float32,
    WireType.BYTES: np.object_,
}


@dataclass(frozen=True, slots=True)
class Port:
    """One tensor of one model: its name, type, dims (-1: any length) and whether it may be left out."""

    tensor: Tensor
    type: WireType
    dims: tuple[int, ...] = (1,)
    optional: bool = True


@dataclass(frozen=True, slots=True)
class Signature:
    model: Model
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    max_batch_size: int = 0

    def port(self, tensor: Tensor) -> Port:
        for p in (*self.inputs, *self.outputs):
            if p.tensor is tensor:
                return p
        raise KeyError(f"{self.model} has no tensor {tensor}")


@dataclass(frozen=True, slots=True)
class SamplingInput:
    """One sampling input of the generating models: its port, and the ``SamplingParams`` field it
    carries as is (None: the codec maps it: ``stream``, ``stop_words`` -> ``stop``, ``end_id`` ->
    ``stop_token_ids``, ``return_log_probs`` + ``top_logprobs`` -> ``logprobs``,
    ``guided_decoding_guide_type`` + ``guided_decoding_guide`` -> ``guide``, ``stop_token_ids`` (with
    ``end_id``), ``logit_bias_ids`` + ``logit_bias_values`` -> ``logit_bias``, and the two that must be
    1). A new scalar sampling input is one line here (plus its ``SamplingParams`` field and the model
    configs, which a test holds to this table)."""

    port: Port
    param: str | None = None


T = Tensor
_I, _F, _B = WireType.INT32, WireType.FP32, WireType.BOOL
SAMPLING: tuple[SamplingInput, ...] = (  # TensorRT-LLM's names
    SamplingInput(Port(T.MAX_TOKENS, _I), "max_tokens"),
    SamplingInput(Port(T.STREAM, _B)),
    SamplingInput(Port(T.TEMPERATURE, _F), "temperature"),
    SamplingInput(Port(T.TOP_K, _I), "top_k"),
    SamplingInput(Port(T.TOP_P, _F), "top_p"),
    SamplingInput(Port(T.RANDOM_SEED, WireType.UINT64), "seed"),
    SamplingInput(Port(T.STOP_WORDS, WireType.BYTES, (-1,))),
    SamplingInput(Port(T.END_ID, _I)),
    SamplingInput(Port(T.BEAM_WIDTH, _I)),
    SamplingInput(Port(T.IGNORE_EOS, _B), "ignore_eos"),
    SamplingInput(Port(T.SPECULATE, _B), "speculate"),
    SamplingInput(Port(T.CACHE_SALT, WireType.BYTES), "cache_salt"),
    SamplingInput(Port(T.GUIDE_TYPE, WireType.BYTES)),
    SamplingInput(Port(T.GUIDE, WireType.BYTES)),
    SamplingInput(Port(T.REPETITION_PENALTY, _F), "repetition_penalty"),
    SamplingInput(Port(T.PRESENCE_PENALTY, _F), "presence_penalty"),
    SamplingInput(Port(T.FREQUENCY_PENALTY, _F), "frequency_penalty"),
    SamplingInput(Port(T.RETURN_LOG_PROBS, _B)),
    SamplingInput(Port(T.TOP_LOGPROBS, _I)),
    SamplingInput(Port(T.PROMPT_LOGPROBS, _I), "prompt_logprobs"),
    SamplingInput(Port(T.MIN_TOKENS, _I), "min_tokens"),
    SamplingInput(Port(T.STOP_TOKEN_IDS, _I, (-1,))),
    SamplingInput(Port(T.LOGIT_BIAS_IDS, _I, (-1,))),
    SamplingInput(Port(T.LOGIT_BIAS_VALUES, _F, (-1,))),
    SamplingInput(Port(T.NUM_RETURN_SEQUENCES, _I)),
)
SAMPLING_PORTS = tuple(s.port for s in SAMPLING)
_TEXT_IN = (Port(T.TEXT_INPUT, WireType.BYTES), Port(T.CHAT, WireType.BOOL))
_ECHO = Port(T.EXCLUDE_INPUT_IN_OUTPUT, WireType.BOOL)
_LOGPROBS = Port(T.OUTPUT_LOG_PROBS, WireType.FP32, (-1,), optional=False)

SIGNATURES: dict[Model, Signature] = {
    Model.PREPROCESSING: Signature(
        Model.PREPROCESSING, (*_TEXT_IN, _ECHO), (Port(T.INPUT_IDS, WireType.INT32, (-1,), optional=False),)
    ),
    Model.DECODE: Signature(
        Model.DECODE,
        (
            Port(T.INPUT_IDS, WireType.INT32, (-1,)),
            Port(T.STOP, WireType.BOOL),
            *SAMPLING_PORTS,
            _ECHO,
            Port(T.KV_EVENTS_QUERY, WireType.BYTES),
        ),
        (
            Port(T.TEXT_OUTPUT, WireType.BYTES, (-1,)),  # sent when asked for (`llm` asks; the router does not)
            Port(T.OUTPUT_IDS, WireType.INT32, (-1,), optional=False),
            Port(T.TEXT_SKIP, WireType.INT32, optional=False),
            Port(T.SEQUENCE_LENGTH, WireType.INT32, optional=False),
            Port(T.CACHED_TOKENS, WireType.INT32, optional=False),
            Port(T.FINISH_REASON, WireType.BYTES, optional=False),
            _LOGPROBS,
            Port(T.TOP_LOGPROB_IDS, WireType.INT32, (-1, -1), optional=False),
            Port(T.TOP_LOGPROB_VALUES, WireType.FP32, (-1, -1), optional=False),
            Port(T.KV_EVENTS, WireType.BYTES, optional=False),
            Port(T.PROMPT_LOG_PROBS, WireType.FP32, (-1,), optional=False),
            Port(T.PROMPT_TOP_IDS, WireType.INT32, (-1, -1), optional=False),
            Port(T.PROMPT_TOP_VALUES, WireType.FP32, (-1, -1), optional=False),
        ),
    ),
    Model.LLM: Signature(
        Model.LLM,
        (_TEXT_IN[0], *SAMPLING_PORTS, _TEXT_IN[1], _ECHO),
        (Port(T.TEXT_OUTPUT, WireType.BYTES, (-1,), optional=False), _LOGPROBS),
    ),
    Model.ENSEMBLE: Signature(
        Model.ENSEMBLE,
        (_TEXT_IN[0], *SAMPLING_PORTS, _TEXT_IN[1], _ECHO, Port(T.PAD_ID, WireType.INT32)),
        (
            Port(T.TEXT_OUTPUT, WireType.BYTES, (-1,), optional=False),
            _LOGPROBS,
            Port(T.CUM_LOG_PROBS, WireType.FP32, optional=False),
        ),
        max_batch_size=1,
    ),
    Model.PREFILL: Signature(
        Model.PREFILL,
        (Port(T.HANDSHAKE, WireType.BYTES), Port(T.PREFILL_REQUEST, WireType.BYTES)),
        (Port(T.ENDPOINT, WireType.BYTES, optional=False), Port(T.LOAD_TOKENS, WireType.INT64, optional=False)),
    ),
}

_PARAMS = {Tensor.RANDOM_SEED: "seed", Tensor.TOP_LOGPROBS: "top_logprobs"}  # OpenAI's names where they differ
_LIMITS = {
    WireType.INT32: (-(2**31), 2**31 - 1),
    WireType.INT64: (-(2**63), 2**63 - 1),
    WireType.UINT64: (0, 2**64 - 1),
}


def array(port: Port, value: object) -> np.ndarray:
    """``value`` (a scalar, a sequence, or for BYTES str / bytes) as the array ``port`` declares.
    ``InvalidRequestError`` naming the tensor when it does not fit the type (an integer out of range)."""
    kind = port.type
    values = list(value) if isinstance(value, Sequence) and not isinstance(value, str | bytes) else [value]
    if kind is WireType.BYTES:
        encoded = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values]  # type: ignore[arg-type]
        return np.array(encoded, dtype=np.object_)
    limits = _LIMITS.get(kind)
    if limits is not None:
        bad = next((v for v in values if not limits[0] <= int(v) <= limits[1]), None)  # type: ignore[arg-type]
        if bad is not None:
            raise InvalidRequestError(
                f"{port.tensor} {bad} does not fit {kind} [{limits[0]}, {limits[1]}]",
                _PARAMS.get(port.tensor, port.tensor),
            )
    return np.array(values, dtype=kind.numpy)


def encode(signature: Signature, values: dict[Tensor, object], outputs: bool = False) -> Arrays:
    """Arrays for ``values`` (None: left out) against the signature's inputs (or outputs)."""
    ports = {p.tensor: p for p in (signature.outputs if outputs else signature.inputs)}
    return {t: array(ports[t], v) for t, v in values.items() if v is not None}


def client_inputs(signature: Signature, arrays: Arrays) -> list[object]:
    """Triton client ``InferInput``s (gRPC, sync or asyncio) for arrays of ``signature``'s inputs."""
    from tritonclient.grpc import InferInput

    ports = {p.tensor: p for p in signature.inputs}
    out = []
    for tensor, value in arrays.items():
        t = InferInput(tensor.value, list(value.shape), ports[tensor].type.value)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


class Reader:
    """Typed getters over what a model received (or a response carried), checked against its ports.
    Every problem is an ``InvalidRequestError`` that names the tensor."""

    def __init__(self, get: Getter, ports: tuple[Port, ...]) -> None:
        self._get = get
        self._ports = {p.tensor: p for p in ports}

    def _raw(self, tensor: Tensor) -> np.ndarray | None:
        arr = self._get(tensor)
        port = self._ports[tensor]
        if arr is None:
            if not port.optional:
                raise InvalidRequestError(f"input {tensor} is missing")
            return None
        want = port.type
        ok = {
            WireType.BOOL: arr.dtype == np.bool_,
            WireType.FP32: arr.dtype.kind == "f",
            WireType.BYTES: arr.dtype.kind in "OSU",
        }.get(want, arr.dtype.kind in "iu")
        if not ok:
            raise InvalidRequestError(f"input {tensor} must be {want}, got {arr.dtype}")
        return arr

    def _one(self, tensor: Tensor) -> object | None:
        arr = self._raw(tensor)
        if arr is None:
            return None
        if arr.size != 1:
            raise InvalidRequestError(f"input {tensor} must hold exactly one value, got shape {list(arr.shape)}")
        return arr.reshape(-1)[0].item() if arr.dtype.kind != "O" else arr.reshape(-1)[0]

    def has(self, tensor: Tensor) -> bool:
        return self._get(tensor) is not None

    def flag(self, tensor: Tensor) -> bool | None:
        value = self._one(tensor)
        return None if value is None else bool(value)

    def integer(self, tensor: Tensor) -> int | None:
        value = self._one(tensor)
        return None if value is None else int(value)  # type: ignore[call-overload]

    def floating(self, tensor: Tensor) -> float | None:
        value = self._one(tensor)
        return None if value is None else float(value)  # type: ignore[arg-type]

    def text(self, tensor: Tensor) -> str | None:
        value = self._one(tensor)
        return None if value is None else _text(value, tensor)

    def texts(self, tensor: Tensor) -> tuple[str, ...]:
        arr = self._raw(tensor)
        return () if arr is None else tuple(_text(x, tensor) for x in arr.reshape(-1))

    def ints(self, tensor: Tensor) -> list[int]:
        arr = self._raw(tensor)
        return [] if arr is None else [int(t) for t in arr.reshape(-1)]

    def floats(self, tensor: Tensor) -> list[float]:
        arr = self._raw(tensor)
        return [] if arr is None else [float(v) for v in arr.reshape(-1)]

    def matrix(self, tensor: Tensor, rows: int) -> np.ndarray:
        """A 2-D tensor of ``rows`` rows (no rows, or none sent: an empty one)."""
        arr = self._raw(tensor)
        return np.zeros((rows, 0)) if arr is None or rows == 0 else arr.reshape(rows, -1)


def _text(raw: object, name: str) -> str:
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"input {name} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if isinstance(raw, str):
        return raw
    raise InvalidRequestError(f"input {name} must be BYTES (a string)")

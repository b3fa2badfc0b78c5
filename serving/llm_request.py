"""The ``llm`` ensemble's inputs (TensorRT-LLM names) -> typed values, per step. No Triton import.

Inputs: ``text_input`` (required), ``chat`` (ours: apply the chat template) for preprocessing;
``max_tokens``, ``stream``, ``temperature``, ``top_k``, ``top_p``, ``random_seed``,
``stop_words``, ``end_id``, ``beam_width``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``return_log_probs`` (+ ``top_logprobs``), ``num_return_sequences`` (1)
for decode. Every problem is an ``InvalidRequestError`` naming the input.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable

import numpy as np

from serving.names import Tensor
from torch_engine.sampling import InvalidRequestError, SamplingParams

Getter = Callable[[str], "np.ndarray | None"]

_KINDS = {
    Tensor.MAX_TOKENS: "i",
    Tensor.TEMPERATURE: "f",
    Tensor.TOP_K: "i",
    Tensor.TOP_P: "f",
    Tensor.RANDOM_SEED: "u",
    Tensor.END_ID: "i",
    Tensor.BEAM_WIDTH: "i",
    Tensor.STREAM: "b",
    Tensor.CHAT: "b",
    Tensor.IGNORE_EOS: "b",
    Tensor.SPECULATE: "b",
    Tensor.EXCLUDE_INPUT_IN_OUTPUT: "b",
    Tensor.REPETITION_PENALTY: "f",
    Tensor.PRESENCE_PENALTY: "f",
    Tensor.FREQUENCY_PENALTY: "f",
    Tensor.RETURN_LOG_PROBS: "b",
    Tensor.TOP_LOGPROBS: "i",
    Tensor.NUM_RETURN_SEQUENCES: "i",
    Tensor.STOP: "b",
}


def _scalar(get: Getter, name: Tensor) -> object | None:
    arr = get(name)
    if arr is None:
        return None
    kind = _KINDS[name]
    if arr.size != 1:
        raise InvalidRequestError(f"input {name} must hold exactly one value, got shape {list(arr.shape)}")
    if kind == "b" and arr.dtype != np.bool_:
        raise InvalidRequestError(f"input {name} must be BOOL, got {arr.dtype}")
    if kind in "iu" and arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"input {name} must be an integer, got {arr.dtype}")
    if kind == "f" and arr.dtype.kind != "f":
        raise InvalidRequestError(f"input {name} must be floating point, got {arr.dtype}")
    value = arr.reshape(-1)[0].item()
    return bool(value) if kind == "b" else value


def _text(raw: object, name: str) -> str:
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(f"input {name} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    if isinstance(raw, str):
        return raw
    raise InvalidRequestError(f"input {name} must be BYTES (a string)")


def parse_text(get: Getter) -> tuple[str, bool]:
    """``text_input`` and ``chat`` (the preprocessing step)."""
    arr = get(Tensor.TEXT_INPUT)
    if arr is None:
        raise InvalidRequestError("input text_input is missing")
    if arr.size != 1:
        raise InvalidRequestError(f"input text_input must hold exactly one string, got shape {list(arr.shape)}")
    prompt = _text(arr.reshape(-1)[0], Tensor.TEXT_INPUT)
    if not prompt.strip():
        raise InvalidRequestError("input text_input is empty")
    return prompt, bool(_scalar(get, Tensor.CHAT) or False)


def parse_stop(get: Getter) -> bool:
    """``stop`` true: a control call that stops the live requests named by its request id (no generation)."""
    return bool(_scalar(get, Tensor.STOP))


def parse_echo(get: Getter, stream: bool) -> bool:
    """``exclude_input_in_output`` false: the output starts with the prompt. As in TensorRT-LLM, only without
    streaming (streamed responses carry the new text only)."""
    return _scalar(get, Tensor.EXCLUDE_INPUT_IN_OUTPUT) is False and not stream


def parse_stop_words(get: Getter) -> tuple[str, ...]:
    stops = get(Tensor.STOP_WORDS)
    return tuple(s for s in (_text(x, Tensor.STOP_WORDS) for x in stops.reshape(-1)) if s) if stops is not None else ()


def parse_sampling(get: Getter, max_tokens_limit: int) -> tuple[SamplingParams, bool]:
    """Sampling inputs and ``stream`` (the decode step)."""
    max_tokens = _scalar(get, Tensor.MAX_TOKENS)
    if max_tokens is not None and not 0 < int(max_tokens) <= max_tokens_limit:  # type: ignore[call-overload]
        raise InvalidRequestError(f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}")
    beam = _scalar(get, Tensor.BEAM_WIDTH)
    if beam is not None and beam != 1:
        raise InvalidRequestError(f"beam_width {beam} is not supported (only 1)")
    end_id = _scalar(get, Tensor.END_ID)
    temperature = _scalar(get, Tensor.TEMPERATURE)
    top_k = _scalar(get, Tensor.TOP_K)
    top_p = _scalar(get, Tensor.TOP_P)
    seed = _scalar(get, Tensor.RANDOM_SEED)
    sequences = _scalar(get, Tensor.NUM_RETURN_SEQUENCES)
    if sequences is not None and sequences != 1:
        raise InvalidRequestError(f"num_return_sequences {sequences} is not supported (only 1)")
    params = SamplingParams(
        max_tokens=int(max_tokens) if max_tokens is not None else 64,  # type: ignore[call-overload]
        temperature=float(temperature) if temperature is not None else 0.0,  # type: ignore[arg-type]
        top_k=int(top_k) if top_k is not None else 0,  # type: ignore[call-overload]
        top_p=float(top_p) if top_p is not None else 1.0,  # type: ignore[arg-type]
        seed=int(seed) if seed is not None else None,  # type: ignore[call-overload]
        stop_token_ids=(int(end_id),) if end_id is not None else (),  # type: ignore[call-overload]
        stop=parse_stop_words(get),
        ignore_eos=bool(_scalar(get, Tensor.IGNORE_EOS) or False),
        repetition_penalty=_float(get, Tensor.REPETITION_PENALTY, 1.0),
        presence_penalty=_float(get, Tensor.PRESENCE_PENALTY, 0.0),
        frequency_penalty=_float(get, Tensor.FREQUENCY_PENALTY, 0.0),
        logprobs=_logprobs(get),
        speculate=_flag(get, Tensor.SPECULATE),
    )
    params.validate()
    return params, bool(_scalar(get, Tensor.STREAM) or False)


def _flag(get: Getter, name: Tensor) -> bool | None:
    value = _scalar(get, name)
    return bool(value) if value is not None else None


def _float(get: Getter, name: Tensor, default: float) -> float:
    value = _scalar(get, name)
    return float(value) if value is not None else default  # type: ignore[arg-type]


def _logprobs(get: Getter) -> int | None:
    """``return_log_probs`` (TensorRT-LLM's input) with ``top_logprobs`` alternatives per token (ours)."""
    top = _scalar(get, Tensor.TOP_LOGPROBS)
    if not _scalar(get, Tensor.RETURN_LOG_PROBS):
        if top:
            raise InvalidRequestError("top_logprobs needs return_log_probs=true")
        return None
    return int(top) if top is not None else 0  # type: ignore[call-overload]


class RequestIds:
    """Engine request ids on one decode node: ``CLIENT#N.NODE-BOOT``. Clients may send the same id
    (or none); the counter makes ids unique on the node, the node's name and a random boot tag make
    them unique across the nodes they travel to (prefill groups key their jobs by them) and across
    restarts of the node."""

    def __init__(self, node: str) -> None:
        self._tag = f"{node}-{secrets.token_hex(3)}"
        self._n = itertools.count()

    def next(self, client: str = "") -> str:
        return f"{client or 'triton'}#{next(self._n)}.{self._tag}"

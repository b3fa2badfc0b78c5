"""One codec per Triton model over the wire contract (``serving/wire.py``): the caller side encodes a
typed value into the model's arrays, the backend side parses the arrays back (and the other way for
responses). Every problem a client can cause is an ``InvalidRequestError`` naming the input.

- ``decode``: ``DecodeCall`` (token ids, ``SamplingParams``, stream, echo) / a ``stop`` control call;
  responses ``DecodePiece`` (a token window, counts, finish reason, log-probabilities).
- ``llm`` / ``ensemble``: text + the same sampling inputs (``encode_llm``); preprocessing reads the text,
  ``decode`` answers ``text_output`` when asked.
- ``prefill``: a ``PrefillRequest`` or a handshake in, the load or an endpoint out.

Sampling inputs are declared once, in ``wire.SAMPLING``: the tensor, its type, the
``SamplingParams`` field it carries; a field at its default is left off the wire. A new scalar
sampling input is that one line (plus its ``SamplingParams`` field and the model configs, which a
test holds to the contract); encoding and parsing follow from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields

import numpy as np
from pydantic import ValidationError

from kv_messenger.protocol import PrefillRequest, RankEndpoint
from serving.kv_events import KVEventBatch, KVEventsQuery
from serving.names import Model, Tensor
from serving.wire import SAMPLING, SIGNATURES, Arrays, Getter, Reader, WireType, encode
from torch_engine.guided import Guide, GuideError, GuideKind
from torch_engine.sampling import InvalidRequestError, SamplingParams, TokenLogprobs

T = Tensor
# scalar sampling inputs carried as is: tensor -> its SamplingParams field (left out at the field's default)
SCALARS: tuple[tuple[Tensor, str], ...] = tuple((s.port.tensor, s.param) for s in SAMPLING if s.param is not None)
_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
DECODE, LLM, PREFILL = (SIGNATURES[m] for m in (Model.DECODE, Model.LLM, Model.PREFILL))


# -- sampling (decode, llm, ensemble) ----------------------------------------------------------
def sampling_values(params: SamplingParams) -> dict[Tensor, object]:
    """What ``params`` puts on the wire (TensorRT-LLM's inputs): fields away from their default."""
    values: dict[Tensor, object] = {t: getattr(params, f) for t, f in SCALARS if getattr(params, f) != _DEFAULTS[f]}
    values[T.MAX_TOKENS] = params.max_tokens  # always: the server's default may differ
    if params.stop:
        values[T.STOP_WORDS] = list(params.stop)
    if params.stop_token_ids:
        values[T.STOP_TOKEN_IDS] = list(params.stop_token_ids)
    if params.logit_bias:
        values[T.LOGIT_BIAS_IDS] = [t for t, _ in params.logit_bias]
        values[T.LOGIT_BIAS_VALUES] = [b for _, b in params.logit_bias]
    if params.logprobs is not None:
        values[T.RETURN_LOG_PROBS] = True
        values[T.TOP_LOGPROBS] = params.logprobs
    if params.guide is not None:
        values[T.GUIDE_TYPE] = params.guide.kind.wire
        if params.guide.text:
            values[T.GUIDE] = params.guide.text
    return values


def check_sampling(params: SamplingParams) -> None:
    """``InvalidRequestError`` (its ``param`` set) when ``params`` is invalid or a value does not fit
    the type the wire carries it in (a ``top_k`` of 2**40 in an INT32)."""
    params.validate()
    encode(DECODE, sampling_values(params))


def parse_sampling(r: Reader, max_tokens_limit: int) -> SamplingParams:
    """The sampling inputs as validated ``SamplingParams`` (``max_tokens`` at most ``max_tokens_limit``)."""
    if (beam := r.integer(T.BEAM_WIDTH)) is not None and beam != 1:
        raise InvalidRequestError(f"beam_width {beam} is not supported (only 1)")
    if (n := r.integer(T.NUM_RETURN_SEQUENCES)) is not None and n != 1:
        raise InvalidRequestError(f"num_return_sequences {n} is not supported (only 1)")
    kw: dict[str, object] = {}
    for tensor, name in SCALARS:
        value: object
        if DECODE.port(tensor).type is WireType.BYTES:
            value = r.text(tensor)
        elif isinstance(_DEFAULTS[name], bool) or name == "speculate":
            value = r.flag(tensor)
        else:
            value = _number(r, tensor)
        if value is not None:
            kw[name] = value
    max_tokens = kw.get("max_tokens")
    if max_tokens is not None and not 0 < max_tokens <= max_tokens_limit:  # type: ignore[operator]
        raise InvalidRequestError(f"max_tokens must be in [1, {max_tokens_limit}], got {max_tokens}")
    top = r.integer(T.TOP_LOGPROBS)
    if r.flag(T.RETURN_LOG_PROBS):
        kw["logprobs"] = top if top is not None else 0
    elif top:
        raise InvalidRequestError("top_logprobs needs return_log_probs=true")
    end_id = r.integer(T.END_ID)
    bias_ids, bias_values = r.ints(T.LOGIT_BIAS_IDS), r.floats(T.LOGIT_BIAS_VALUES)
    if len(bias_ids) != len(bias_values):
        raise InvalidRequestError(f"{T.LOGIT_BIAS_IDS} and {T.LOGIT_BIAS_VALUES} differ in length", T.LOGIT_BIAS_IDS)
    params = SamplingParams(
        **kw,  # type: ignore[arg-type]
        stop=tuple(s for s in r.texts(T.STOP_WORDS) if s),
        stop_token_ids=((end_id,) if end_id is not None else ()) + tuple(r.ints(T.STOP_TOKEN_IDS)),
        guide=_guide(r),
        logit_bias=tuple(zip(bias_ids, bias_values, strict=True)),
    )
    params.validate()
    return params


def _guide(r: Reader) -> Guide | None:
    """TensorRT-LLM's two guided-decoding inputs as a ``Guide`` (compiled by ``validate``)."""
    kind, text = r.text(T.GUIDE_TYPE), r.text(T.GUIDE)
    if kind is None:
        if text is not None:
            raise InvalidRequestError(f"{T.GUIDE} needs {T.GUIDE_TYPE}", T.GUIDE_TYPE)
        return None
    try:
        parsed = GuideKind.parse(kind)
    except GuideError as exc:
        raise InvalidRequestError(str(exc), T.GUIDE_TYPE) from None
    if parsed is not GuideKind.JSON and text is None:
        raise InvalidRequestError(f"{T.GUIDE_TYPE} {kind!r} needs {T.GUIDE}", T.GUIDE)
    return Guide(parsed, text or "")


def _number(r: Reader, tensor: Tensor) -> int | float | None:
    return r.floating(tensor) if DECODE.port(tensor).type is WireType.FP32 else r.integer(tensor)


# -- decode ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DecodeCall:
    """A generation request to ``decode``."""

    ids: list[int]
    params: SamplingParams
    stream: bool
    echo: bool = False  # the (unstreamed) output starts with the prompt


def encode_decode(call: DecodeCall) -> Arrays:
    values = {T.INPUT_IDS: call.ids, **sampling_values(call.params), T.STREAM: call.stream}
    if call.echo:
        values[T.EXCLUDE_INPUT_IN_OUTPUT] = False
    return encode(DECODE, values)


def encode_events_query(q: KVEventsQuery) -> Arrays:
    """A router's prefix-cache event poll (``serving.kv_events``)."""
    return encode(DECODE, {T.KV_EVENTS_QUERY: q.model_dump_json()})


def events_query(get: Getter) -> KVEventsQuery | None:
    """The event poll this call is, or None (a generation or a stop)."""
    raw = Reader(get, DECODE.inputs).text(T.KV_EVENTS_QUERY)
    if raw is None:
        return None
    try:
        return KVEventsQuery.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidRequestError(f"input kv_events_query is not a KVEventsQuery: {exc}") from None


def encode_events(batch: KVEventBatch) -> Arrays:
    return encode(DECODE, {T.KV_EVENTS: batch.model_dump_json()}, outputs=True)


def parse_events(get: Getter) -> KVEventBatch:
    raw = Reader(get, DECODE.outputs).text(T.KV_EVENTS)
    if raw is None:
        raise InvalidRequestError("the response has no kv_events")
    try:
        return KVEventBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidRequestError(f"output kv_events is not a KVEventBatch: {exc}") from None


def encode_stop() -> Arrays:
    """TensorRT-LLM's stop request: abort the live requests this call's request id names."""
    return encode(DECODE, {T.STOP: True})


def is_stop(get: Getter) -> bool:
    return bool(Reader(get, DECODE.inputs).flag(T.STOP))


def parse_decode(get: Getter, max_tokens_limit: int) -> DecodeCall:
    r = Reader(get, DECODE.inputs)
    params = parse_sampling(r, max_tokens_limit)
    if not r.has(T.INPUT_IDS):
        raise InvalidRequestError("input input_ids is missing")
    stream = bool(r.flag(T.STREAM))
    # as in TensorRT-LLM, only without streaming (streamed responses carry the new text only)
    echo = r.flag(T.EXCLUDE_INPUT_IN_OUTPUT) is False and not stream
    return DecodeCall(r.ints(T.INPUT_IDS), params, stream, echo)


@dataclass(frozen=True, slots=True)
class DecodePiece:
    """One ``decode`` response: ``window`` decodes, past its first ``skip`` tokens, to the new text."""

    window: tuple[int, ...]
    skip: int
    generated: int  # tokens generated so far (the new ones are the window's last tokens)
    finish_reason: str  # "" until the last piece: "stop" or "length"
    logprobs: tuple[float, ...] = ()  # of the new tokens
    top_ids: tuple[tuple[int, ...], ...] = ()  # per new token, its top alternatives
    top_logprobs: tuple[tuple[float, ...], ...] = ()
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt: Scores = None  # the prompt tokens' (from the second), on the first piece, when asked for
    text: str = ""  # the new text: the window's, cut at a stop string (``llm``'s text_output)


@dataclass(frozen=True, slots=True)
class ScoreRows:
    """Tokens' log-probabilities and their top alternatives (a piece's prompt: tokens 1.., token 0 has none)."""

    logprobs: tuple[float, ...]
    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]


Scores = ScoreRows | None


def prompt_scores(lps: tuple[TokenLogprobs | None, ...]) -> ScoreRows:
    """The engine's prompt log-probabilities (the first None) as the wire carries them."""
    rows = [lp for lp in lps[1:] if lp is not None]
    return ScoreRows(
        tuple(lp.logprob for lp in rows), tuple(lp.top_ids for lp in rows), tuple(lp.top_logprobs for lp in rows)
    )


def encode_piece(p: DecodePiece, asked: Collection[str] | None = None) -> Arrays:
    """A piece's arrays: only the outputs in ``asked`` (a request's ``requested_output_names``; None: all)."""
    n, k = len(p.logprobs), len(p.top_ids[0]) if p.top_ids else 0
    s = p.prompt or ScoreRows((), (), ())
    m, j = len(s.logprobs), len(s.top_ids[0]) if s.top_ids else 0
    build: dict[Tensor, Callable[[], object]] = {
        T.TEXT_OUTPUT: lambda: [p.text],
        T.OUTPUT_IDS: lambda: list(p.window),
        T.TEXT_SKIP: lambda: p.skip,
        T.SEQUENCE_LENGTH: lambda: p.generated,
        T.CACHED_TOKENS: lambda: p.cached,
        T.FINISH_REASON: lambda: p.finish_reason,
        T.OUTPUT_LOG_PROBS: lambda: list(p.logprobs),
    }
    arrays: dict[Tensor, Callable[[], np.ndarray]] = {  # set as they are (the port's own shape)
        T.PROMPT_LOG_PROBS: lambda: np.array(s.logprobs, dtype=np.float32),
        T.TOP_LOGPROB_IDS: lambda: np.array(p.top_ids, dtype=np.int32).reshape(n, k),
        T.TOP_LOGPROB_VALUES: lambda: np.array(p.top_logprobs, dtype=np.float32).reshape(n, k),
        T.PROMPT_TOP_IDS: lambda: np.array(s.top_ids, dtype=np.int32).reshape(m, j),
        T.PROMPT_TOP_VALUES: lambda: np.array(s.top_logprobs, dtype=np.float32).reshape(m, j),
    }
    out = encode(DECODE, {t: f() for t, f in build.items() if asked is None or t in asked}, outputs=True)
    return out | {t: f() for t, f in arrays.items() if asked is None or t in asked}


def parse_piece(get: Getter, top_logprobs: int | None, prompt_top: int | None = None) -> DecodePiece:
    """A ``decode`` response (``top_logprobs``: the alternatives asked for; None: no log-probabilities;
    ``prompt_top``: the same for the prompt's)."""
    r = Reader(get, DECODE.outputs)
    piece = DecodePiece(
        tuple(r.ints(T.OUTPUT_IDS)), r.integer(T.TEXT_SKIP) or 0, r.integer(T.SEQUENCE_LENGTH) or 0,
        r.text(T.FINISH_REASON) or "", cached=r.integer(T.CACHED_TOKENS) or 0,
        prompt=_scores(r, (T.PROMPT_LOG_PROBS, T.PROMPT_TOP_IDS, T.PROMPT_TOP_VALUES), prompt_top),
        text="".join(r.texts(T.TEXT_OUTPUT)),
    )  # fmt: skip
    new = _scores(r, (T.OUTPUT_LOG_PROBS, T.TOP_LOGPROB_IDS, T.TOP_LOGPROB_VALUES), top_logprobs)
    if new is None:
        return piece
    return DecodePiece(
        piece.window, piece.skip, piece.generated, piece.finish_reason, new.logprobs, new.top_ids, new.top_logprobs,
        cached=piece.cached, prompt=piece.prompt, text=piece.text,
    )  # fmt: skip


def _scores(r: Reader, tensors: tuple[Tensor, Tensor, Tensor], k: int | None) -> Scores:
    """Log-probabilities and their top ``k`` alternatives (None: not asked for, or none sent)."""
    if k is None or not r.has(tensors[0]):
        return None
    values = r.floats(tensors[0])
    ids = r.matrix(tensors[1], len(values))[:, :k]
    tops = r.matrix(tensors[2], len(values))[:, :k]
    return ScoreRows(
        tuple(values),
        tuple(tuple(int(t) for t in row) for row in ids),
        tuple(tuple(float(v) for v in row) for row in tops),
    )


# -- llm / preprocessing -------------------------------------------------------------------------
def encode_llm(prompt: str, params: SamplingParams, stream: bool, chat: bool = False) -> Arrays:
    values = {T.TEXT_INPUT: prompt, **sampling_values(params), T.STREAM: stream, T.CHAT: chat}
    return encode(LLM, values)


def parse_text(get: Getter) -> tuple[str, bool]:
    """``text_input`` and ``chat`` (the preprocessing step)."""
    r = Reader(get, SIGNATURES[Model.PREPROCESSING].inputs)
    if not r.has(T.TEXT_INPUT):
        raise InvalidRequestError("input text_input is missing")
    prompt = r.text(T.TEXT_INPUT) or ""
    if not prompt.strip():
        raise InvalidRequestError("input text_input is empty")
    return prompt, bool(r.flag(T.CHAT))


def encode_ids(ids: list[int]) -> Arrays:
    return encode(SIGNATURES[Model.PREPROCESSING], {T.INPUT_IDS: ids}, outputs=True)


def parse_text_output(get: Getter) -> str:
    """``text_output`` of ``llm`` (the client side): every piece joined."""
    return "".join(Reader(get, LLM.outputs).texts(T.TEXT_OUTPUT))


# -- prefill -----------------------------------------------------------------------------------
def encode_prefill(req: PrefillRequest) -> Arrays:
    return encode(PREFILL, {T.PREFILL_REQUEST: req.model_dump_json()})


def parse_prefill_call(get: Getter) -> PrefillRequest | list[RankEndpoint]:
    """A prefill request, or a handshake's decode endpoints (``ValueError`` / pydantic's on bad JSON)."""
    r = Reader(get, PREFILL.inputs)
    if (hs := r.text(T.HANDSHAKE)) is not None:
        return [RankEndpoint.model_validate(e) for e in json.loads(hs)]
    if (pr := r.text(T.PREFILL_REQUEST)) is not None:
        return PrefillRequest.model_validate_json(pr)
    raise InvalidRequestError(f"send {T.HANDSHAKE} or {T.PREFILL_REQUEST}")


def encode_load(load_tokens: int) -> Arrays:
    return encode(PREFILL, {T.LOAD_TOKENS: load_tokens}, outputs=True)


def parse_load(get: Getter) -> int:
    return Reader(get, PREFILL.outputs).integer(T.LOAD_TOKENS) or 0


def encode_endpoint(endpoint: RankEndpoint) -> Arrays:
    return encode(PREFILL, {T.ENDPOINT: endpoint.model_dump_json()}, outputs=True)

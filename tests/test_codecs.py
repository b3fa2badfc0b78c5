"""The wire contract's codecs: what a caller encodes, the backend parses back unchanged (and the
other way for responses), every array has its signature's type, and a value that does not fit its
type, or an array of the wrong type, is refused with a message that names the tensor."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_messenger.protocol import PrefillRequest
from serving import codecs
from serving.codecs import DecodeCall, DecodePiece
from serving.names import Model, Tensor
from serving.wire import SIGNATURES, Arrays, Getter, Reader, WireType
from torch_engine.guided import Guide, GuideKind
from torch_engine.sampling import InvalidRequestError, SamplingParams, TokenLogprobs


def getter(arrays: Arrays) -> Getter:
    return lambda name: arrays.get(Tensor(name))


def typed(model: Model, arrays: Arrays, outputs: bool = False) -> None:
    sig = SIGNATURES[model]
    for tensor, value in arrays.items():
        want = sig.port(tensor).type
        assert value.dtype == np.dtype(want.numpy), f"{tensor}: {value.dtype} is not {want}"
        assert value.ndim == len(sig.port(tensor).dims), tensor


params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.sampled_from([0.0, 1e-40, 0.7, 1.0, 1e30]),
    top_k=st.integers(0, 2**31 - 1),
    top_p=st.sampled_from([1e-40, 0.5, 1.0]),
    seed=st.none() | st.integers(0, 2**63 - 1),
    stop_token_ids=st.sampled_from([(), (7,), (7, 9, 11)]),
    min_tokens=st.integers(0, 1),
    logit_bias=st.lists(st.tuples(st.integers(0, 2**31 - 1), st.sampled_from([-100.0, -0.5, 0.0, 2.25, 100.0])),
                        max_size=4).map(tuple),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    repetition_penalty=st.sampled_from([1.0, 1e-40, 1.3]),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    speculate=st.none() | st.booleans(),
    guide=st.sampled_from([
        None, Guide(GuideKind.JSON),
        Guide(GuideKind.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
        Guide(GuideKind.REGEX, "[0-9]{3}-é"), Guide(GuideKind.EBNF, 'root ::= "yes" | "no"'),
        Guide(GuideKind.LARK, 'start: "a"+'),
    ]),
)  # fmt: skip


def same(a: SamplingParams, b: SamplingParams) -> bool:
    """Equal as the wire carries them (floats in FP32)."""
    f32 = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    for name in SamplingParams.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if (name in f32 and float(np.float32(x)) != y) or (name not in f32 and x != y):
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(p=params, ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20), stream=st.booleans())
def test_a_decode_call_round_trips(p: SamplingParams, ids: list[int], stream: bool) -> None:
    arrays = codecs.encode_decode(DecodeCall(ids, p, stream))
    typed(Model.DECODE, arrays)
    back = codecs.parse_decode(getter(arrays), 4096)
    assert back.ids == ids and back.stream == stream and not back.echo
    assert same(p, back.params), (p, back.params)


@settings(max_examples=100, deadline=None)
@given(p=params, prompt=st.text(min_size=1).filter(str.strip), chat=st.booleans())
def test_an_llm_call_carries_the_same_sampling_inputs(p: SamplingParams, prompt: str, chat: bool) -> None:
    arrays = codecs.encode_llm(prompt, p, True, chat)
    typed(Model.LLM, arrays)
    assert codecs.parse_text(getter(arrays)) == (prompt, chat)
    assert same(p, codecs.parse_sampling(Reader(getter(arrays), SIGNATURES[Model.LLM].inputs), 4096))


def test_echo_stop_and_defaults() -> None:
    arrays = codecs.encode_decode(DecodeCall([1, 2], SamplingParams(), False, echo=True))
    assert codecs.parse_decode(getter(arrays), 64).echo
    assert set(arrays) == {Tensor.INPUT_IDS, Tensor.MAX_TOKENS, Tensor.STREAM, Tensor.EXCLUDE_INPUT_IN_OUTPUT}
    assert codecs.is_stop(getter(codecs.encode_stop())) and not codecs.is_stop(getter(arrays))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({Tensor.GUIDE_TYPE: "xml"}, "guided_decoding_guide_type 'xml' is not supported"),
        ({Tensor.GUIDE: "[0-9]"}, "guided_decoding_guide needs guided_decoding_guide_type"),
        ({Tensor.GUIDE_TYPE: "regex"}, "'regex' needs guided_decoding_guide"),
        ({Tensor.GUIDE_TYPE: "regex", Tensor.GUIDE: "(ab"}, "(?s)invalid regex guide: .*unclosed group"),
        ({Tensor.GUIDE_TYPE: "json_schema", Tensor.GUIDE: "{nope"}, "invalid json_schema guide: Expecting property"),
        ({Tensor.GUIDE_TYPE: "json_schema", Tensor.GUIDE: '{"type": "frob"}'}, "(?s)invalid json_schema guide: .*frob"),
        ({Tensor.GUIDE_TYPE: "json_schema", Tensor.GUIDE: "[1]"}, "a JSON schema here is an object, not list"),
        ({Tensor.GUIDE_TYPE: "ebnf_grammar", Tensor.GUIDE: "root ::= foo"}, "invalid ebnf_grammar guide"),
        ({Tensor.GUIDE_TYPE: "lark_grammar", Tensor.GUIDE: "start: foo"}, 'unknown name: "foo"'),
        ({Tensor.GUIDE_TYPE: "regex", Tensor.GUIDE: "a" * 100_001}, "at most 100000 characters"),
    ],
)
def test_a_bad_guide_is_refused_by_name(arrays: dict[Tensor, str], match: str) -> None:
    base = codecs.encode_decode(DecodeCall([1, 2], SamplingParams(), False))
    extra = codecs.encode(codecs.DECODE, dict(arrays))
    with pytest.raises(InvalidRequestError, match=match):
        codecs.parse_decode(getter(base | extra), 64)


@pytest.mark.parametrize("k", [None, 0, 2])
def test_prompt_scores_round_trip(k: int | None) -> None:
    lps = (None, TokenLogprobs(-0.5, (1, 2), (-0.25, -0.5)), TokenLogprobs(-1.5, (3, 4), (-1.0, -1.5)))
    piece = DecodePiece((5,), 0, 1, "length", prompt=codecs.prompt_scores(lps))
    arrays = codecs.encode_piece(piece)
    typed(Model.DECODE, arrays, outputs=True)
    back = codecs.parse_piece(getter(arrays), None, k).prompt
    if k is None:
        assert back is None
        return
    assert back is not None and back.logprobs == (-0.5, -1.5)
    assert back.top_ids == ((1, 2)[:k], (3, 4)[:k]) and back.top_logprobs == ((-0.25, -0.5)[:k], (-1.0, -1.5)[:k])


@pytest.mark.parametrize("k", [None, 0, 3])
def test_a_decode_piece_round_trips(k: int | None) -> None:
    tops = 3 if k is None else k
    piece = DecodePiece(
        (5, 6, 7), 1, 9, "length", (-0.5, -1.25),
        ((1, 2, 3)[:tops], (4, 5, 6)[:tops]), ((-0.5, -1.0, -2.0)[:tops], (-1.25, -2.0, -3.0)[:tops]),
        text="héllo",
    )  # fmt: skip
    arrays = codecs.encode_piece(piece)
    typed(Model.DECODE, arrays, outputs=True)
    back = codecs.parse_piece(getter(arrays), k)
    assert (back.window, back.skip, back.generated, back.finish_reason) == (piece.window, 1, 9, "length")
    assert back.text == "héllo" == codecs.parse_text_output(getter(arrays))
    if k is not None:
        assert (back.logprobs, back.top_ids, back.top_logprobs) == (piece.logprobs, piece.top_ids, piece.top_logprobs)
    asked = {Tensor.OUTPUT_IDS, Tensor.TOP_LOGPROB_IDS}  # a caller's requested_output_names: only those built
    only = codecs.encode_piece(piece, {t.value for t in asked})
    assert set(only) == asked and all(only[t].tolist() == arrays[t].tolist() for t in asked)


def test_prefill_round_trip() -> None:
    req = PrefillRequest(request_id="r", epoch=2, prompt_ids=[1, 2, 3], dst_pages=[4], decode_ranks=["d0"])
    arrays = codecs.encode_prefill(req)
    typed(Model.PREFILL, arrays)
    assert codecs.parse_prefill_call(getter(arrays)) == req
    assert codecs.parse_load(getter(codecs.encode_load(123))) == 123


@pytest.mark.parametrize(
    ("params", "match", "param"),
    [
        (SamplingParams(top_k=2**40), r"top_k 1099511627776 does not fit INT32", "top_k"),
        (SamplingParams(max_tokens=2**31), "max_tokens 2147483648 does not fit INT32", "max_tokens"),
        (SamplingParams(logprobs=2**33), "logprobs must be in", "logprobs"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs must be in", "prompt_logprobs"),
        (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias holds at most", "logit_bias"),
        (SamplingParams(min_tokens=9, max_tokens=8), "min_tokens must be in", "min_tokens"),
    ],
)
def test_values_that_do_not_fit_their_wire_type_are_refused_by_name(params, match: str, param) -> None:
    with pytest.raises(InvalidRequestError, match=match) as err:
        codecs.check_sampling(params)
    assert err.value.param == param


@pytest.mark.parametrize(
    ("tensor", "value", "match"),
    [
        (Tensor.TEMPERATURE, np.array([1], np.int32), "input temperature must be FP32, got int32"),
        (Tensor.STREAM, np.array([1], np.int32), "input stream must be BOOL"),
        (Tensor.MAX_TOKENS, np.array([1.5], np.float32), "input max_tokens must be INT32, got float32"),
        (Tensor.MAX_TOKENS, np.array([1, 2], np.int32), "must hold exactly one value"),
        (Tensor.STOP_WORDS, np.array([b"\xff"], np.object_), "input stop_words is not valid UTF-8"),
    ],
)
def test_arrays_of_the_wrong_type_are_refused_by_name(tensor: Tensor, value: np.ndarray, match: str) -> None:
    arrays = codecs.encode_decode(DecodeCall([1, 2], SamplingParams(), False)) | {tensor: value}
    with pytest.raises(InvalidRequestError, match=match):
        codecs.parse_decode(getter(arrays), 64)


def test_every_wire_type_has_a_numpy_type_and_a_config_name() -> None:
    assert {t.config for t in WireType} == {"TYPE_BOOL", "TYPE_INT32", "TYPE_INT64", "TYPE_UINT64", "TYPE_FP32",
                                            "TYPE_STRING"}  # fmt: skip


def test_every_sampling_field_travels_on_the_wire() -> None:
    """Each ``SamplingParams`` field is carried by a declared sampling input (or by the five the
    codec maps), so a new field cannot be dropped on the way from the router to the engine."""
    from dataclasses import fields

    from serving.wire import SAMPLING

    carried = {s.param for s in SAMPLING if s.param is not None} | {
        "stop",
        "stop_token_ids",
        "logprobs",
        "guide",
        "logit_bias",
    }
    assert {f.name for f in fields(SamplingParams)} == carried

"""Constrained decoding in the engine (SmolLM2 fp32): every output follows its guide, checked by an
independent reference (Python's ``json`` and ``re``, the schema's own fields); drafting, batching
and preemption change nothing; a broken grammar fails its own request only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_engine
from tests.split_harness import ScriptedCaller, cluster, wait_for
from torch_engine.config import EngineConfig, SpecMethod, SpeculativeConfig
from torch_engine.engine import LLMEngine
from torch_engine.guided import GrammarState, Guide, GuideError, GuideKind, apply_masks
from torch_engine.kernels import cpu_kernels
from torch_engine.request import FinishReason, RequestState
from torch_engine.sampling import InvalidRequestError, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = Guide(GuideKind.JSON_SCHEMA, json.dumps(PERSON))
PHONE = Guide(GuideKind.REGEX, r"\(\d{3}\) \d{3}-\d{4}")


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return tiny_engine(smollm2_dir, num_pages=96, tokenizer=True)


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(text, chat=True)


def _text(engine: LLMEngine, ids: list[int]) -> str:
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(ids)


def _run(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """The requests batched together, to the end; their output tokens."""
    rids = [engine.add_request(p, s) for p, s in work]
    while engine.has_unfinished():
        engine.step()
    return [engine.request(r).output_ids for r in rids]


def _person_ok(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "city"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 24
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert value["city"] in PERSON["properties"]["city"]["enum"]  # type: ignore[index]


def test_greedy_and_sampled_outputs_follow_the_schema(engine: LLMEngine) -> None:
    prompt = _prompt(engine, "Invent a person. Answer in JSON.")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=60, guide=SCHEMA))[0]
    _person_ok(_text(engine, greedy))
    sampled = _run(
        engine,
        [(prompt, SamplingParams(max_tokens=60, temperature=1.0, top_p=0.95, seed=s, guide=SCHEMA)) for s in range(4)],
    )
    for out in sampled:
        _person_ok(_text(engine, out))
    assert len({tuple(o) for o in sampled}) > 1  # really sampled
    assert engine.page_stats().used == 0


@pytest.mark.parametrize(
    ("guide", "check"),
    [
        (PHONE, lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        (Guide(GuideKind.JSON), lambda t: isinstance(json.loads(t), dict)),
        (Guide(GuideKind.EBNF, 'root ::= ("yes" | "no") "."'), lambda t: t in ("yes.", "no.")),
        (Guide(GuideKind.LARK, 'start: "Paris" | "Lyon" | "Nice"'), lambda t: t in ("Paris", "Lyon", "Nice")),
    ],
    ids=["regex", "json_object", "ebnf", "lark"],
)
def test_each_guide_kind_is_followed(engine: LLMEngine, guide: Guide, check) -> None:
    prompt = _prompt(engine, "What is the phone number and the capital of France? Answer briefly.")
    out = engine.generate([prompt], SamplingParams(max_tokens=40, guide=guide))[0]
    assert check(_text(engine, out)), _text(engine, out)


def test_a_guided_request_leaves_its_neighbours_untouched(engine: LLMEngine) -> None:
    a, b = _prompt(engine, "Tell me about the sea."), _prompt(engine, "Invent a person. Answer in JSON.")
    alone = engine.generate([a], SamplingParams(max_tokens=16))[0]
    together = _run(engine, [(a, SamplingParams(max_tokens=16)), (b, SamplingParams(max_tokens=60, guide=SCHEMA))])
    assert together[0] == alone
    _person_ok(_text(engine, together[1]))


def test_drafting_changes_no_constrained_token(smollm2_dir: Path, engine: LLMEngine) -> None:
    """n-gram drafts are cut to what the grammar accepts and verified under its masks: greedy tokens equal
    the plain constrained run, and some drafts are accepted (the JSON repeats the prompt's words)."""
    spec = tiny_engine(
        smollm2_dir, num_pages=96, tokenizer=True,
        speculative=SpeculativeConfig(method=SpecMethod.NGRAM, num_tokens=4, default=True),
    )  # fmt: skip
    prompt = _prompt(engine, 'Copy this JSON exactly: {"name": "Ada Lovelace", "age": 36, "city": "London"}')
    plain = engine.generate([prompt], SamplingParams(max_tokens=40, guide=SCHEMA))[0]
    drafted = spec.generate([prompt], SamplingParams(max_tokens=40, guide=SCHEMA))[0]
    assert drafted == plain
    _person_ok(_text(engine, drafted))
    assert spec.spec_stats.accepted > 0


def test_preemption_keeps_the_grammar_state(smollm2_dir: Path, engine: LLMEngine) -> None:
    """A pool too small for all four: requests are preempted and recomputed; outputs equal a roomy run."""
    prompts = [_prompt(engine, f"Invent person number {i}. Answer in JSON.") for i in range(4)]
    params = SamplingParams(max_tokens=48, guide=SCHEMA)
    roomy = engine.generate(prompts, params)
    tight = tiny_engine(smollm2_dir, num_pages=12, tokenizer=True, prefix_cache=False)
    assert tight.generate(prompts, params) == roomy
    for out in roomy:
        _person_ok(_text(engine, out))


def test_a_grammar_that_cannot_finish_ends_by_length(engine: LLMEngine) -> None:
    rid = engine.add_request(
        _prompt(engine, "Count."), SamplingParams(max_tokens=5, guide=Guide(GuideKind.REGEX, "a{50}"))
    )
    while engine.has_unfinished():
        engine.step()
    req = engine.request(rid)
    text = _text(engine, req.output_ids)
    assert (
        req.finish_reason is FinishReason.LENGTH and len(req.output_ids) == 5 and set(text) == {"a"} and len(text) < 50
    )


def test_a_broken_grammar_fails_its_request_alone(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(engine, "Tell me about the sea.")
    alone = engine.generate([prompt], SamplingParams(max_tokens=10))[0]
    bad = engine.add_request(prompt, SamplingParams(max_tokens=10, guide=PHONE))
    good = engine.add_request(prompt, SamplingParams(max_tokens=10))

    def broken(self: GrammarState, draft: list[int]) -> torch.Tensor:
        raise GuideError("grammar error: out of fuel")

    monkeypatch.setattr(GrammarState, "masks", broken)
    while engine.has_unfinished():
        engine.step()
    assert engine.request(bad).state is RequestState.FAILED and "out of fuel" in (engine.request(bad).error or "")
    assert engine.request(good).output_ids == alone
    assert engine.page_stats().used == 0


def test_bad_guides_are_refused_by_name(smollm2_dir: Path, engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="invalid regex guide") as info:
        engine.add_request([1, 2, 3], SamplingParams(guide=Guide(GuideKind.REGEX, "(ab")))
    assert info.value.param == "guide"
    no_tokenizer = tiny_engine(smollm2_dir, num_pages=8)
    with pytest.raises(InvalidRequestError, match="structured output needs a tokenizer"):
        no_tokenizer.add_request([1, 2, 3], SamplingParams(guide=PHONE))


@pytest.mark.parametrize("vocab", [70, 100])  # fewer logits than the mask's bits; more (past them: disallowed)
@pytest.mark.parametrize("compiled", [False, True])
def test_masks_set_exactly_the_disallowed_logits_to_minus_inf(vocab: int, compiled: bool) -> None:
    kernels = cpu_kernels() if compiled else None
    if compiled and kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    torch.manual_seed(0)
    rows = [2, 0]
    logits = torch.randn(3, vocab)
    before = logits.clone()
    allowed = torch.rand(2, 96) < 0.3
    allowed[0, :32] = True  # a word with every bit set
    words = [[sum(1 << b for b in range(32) if allowed[r, 32 * w + b]) for w in range(3)] for r in range(2)]
    masks = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)
    apply_masks(logits, rows, masks, kernels)
    for i, r in enumerate(rows):
        for t in range(vocab):
            want = before[r, t] if t < 96 and allowed[i, t] else float("-inf")
            assert logits[r, t] == want
    assert torch.equal(logits[1], before[1])


def test_a_guided_request_across_the_split_survives_failover(
    smollm2_dir: Path, tiny_engine_dir, engine: LLMEngine
) -> None:
    """The decoder owns the grammar: prefilled on group 0, whose call then times out (the decoder cannot
    know it was taken), the request fails over to group 1 on fresh pages and still gives the colocated
    constrained tokens; every page comes back."""
    prompt = _prompt(engine, "Invent a person. Answer in JSON.")
    params = SamplingParams(max_tokens=48, guide=SCHEMA)
    want = engine.generate([prompt], params)[0]
    c = cluster(tiny_engine_dir, engine_dir=smollm2_dir, decode_pages=64)
    try:
        ScriptedCaller.mode[0] = "timeout"
        out = c.run({"v": prompt}, params)["v"]
        assert out.error is None and out.output_ids == want
        _person_ok(_text(engine, out.output_ids))
        assert all(p.engine.cache_stats().queries >= 1 for p in c.prefills)  # both groups were asked: failover
        wait_for(c.settled, what="every page back")
    finally:
        c.stop()


@pytest.mark.parametrize("regex", ["£\U00043fa5", "àá\x06"])
def test_a_guide_that_needs_bytes_no_token_holds_fails_its_request_alone(smollm2_dir: Path, regex: str) -> None:
    """SmolLM2's vocabulary has no token for the byte 0xF1 (the first byte of U+43FA5): the guide's
    mask still allows a token that its parser then refuses. After ``àá`` no token of it continues with
    the byte 0x06 (llguidance's matcher stops with ``NoExtensionBias`` when it computes the mask; the
    router fuzz found it). Either request ends with an error naming the guide, in one line; a request
    beside it keeps its tokens."""
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=64))
    other = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], other)[0]
    bad = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, guide=Guide(GuideKind.REGEX, regex)))
    beside = engine.add_request([5, 6, 7], other)
    while engine.has_unfinished():
        engine.step()
    req = engine.request(bad)
    assert req.finish_reason is FinishReason.ERROR and req.error is not None
    assert req.error.startswith("the guide cannot be followed with this model's tokens") and "\n" not in req.error
    assert list(engine.request(beside).output_ids) == alone and engine.page_stats().used == 0

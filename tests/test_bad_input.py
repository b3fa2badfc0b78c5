"""Bad input gets a clear error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_engine
from torch_engine import sampling
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason, RequestState
from torch_engine.sampling import MIN_TEMPERATURE, InvalidRequestError, SamplingParams


@pytest.fixture
def engine(tiny_engine_dir) -> LLMEngine:
    return tiny_engine(tiny_engine_dir("llama"), num_pages=64)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "prompt is empty"),
        (list(range(200)) * 3, SamplingParams(), "context holds 512"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens must be a positive integer, got 0"),
        ([1, 2, 3], SamplingParams(max_tokens=-5), "max_tokens"),
        ([1, 2, 3], SamplingParams(temperature=-0.1), "temperature must be >= 0, got -0.1"),
        ([1, 2, 3], SamplingParams(temperature=float("nan")), "temperature"),
        ([1, 2, 3], SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(top_k=-1), "top_k must be an integer >= 0, got -1"),
        ([1, 2, 999], SamplingParams(), r"token id 999 is outside the vocabulary \[0, 256\)"),
        ([1, -2], SamplingParams(), "token id -2"),
        ([1, 2, 3], SamplingParams(stop=("",)), "stop strings must not be empty"),
        ([1, 2, 3], SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
        ([1, 2, 3], SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
        ([1, 2, 3], SamplingParams(logit_bias=((999, 1.0),)), r"logit_bias token id 999 is outside the vocabulary"),
        ([1, 2, 3], SamplingParams(logit_bias=((5, float("nan")),)), "logit_bias holds at most"),
        ([1, 2, 3], SamplingParams(min_tokens=-1), "min_tokens must be in"),
        ([1, 2, 3], SamplingParams(stop_token_ids=(-3,)), "stop_token_ids holds"),
    ],
)
def test_bad_request_is_rejected_and_engine_keeps_serving(engine: LLMEngine, prompt, params, match: str) -> None:
    busy = engine.add_request([7, 8, 9, 10], SamplingParams(max_tokens=5))  # another request in flight
    engine.step()
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.request(busy).output_ids) == 5
    assert engine.generate([[4, 5, 6]], SamplingParams(max_tokens=3))[0]  # a normal request right after
    assert engine.page_stats().used == 0


def test_prompt_larger_than_the_pool(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"), num_pages=4)  # 16 tokens of KV
    with pytest.raises(InvalidRequestError, match="prompt needs 6 KV pages; the pool has 4"):
        engine.add_request(list(range(20)))


def test_duplicate_request_id(engine: LLMEngine) -> None:
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(InvalidRequestError, match="'a' is already in use"):
        engine.add_request([1, 2], request_id="a")


def test_text_prompt_without_tokenizer(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("hello")


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"engine.json is missing"):
        LLMEngine(EngineConfig(engine_dir=tmp_path / "nope"))


def test_corrupt_engine_dir(tiny_engine_dir, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine_dir("llama"), bad)
    (bad / "rank0.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"rank0\.safetensors is corrupt"):
        LLMEngine(EngineConfig(engine_dir=bad), load_tokenizer=False)
    (bad / "engine.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"engine\.json is corrupt"):
        LLMEngine(EngineConfig(engine_dir=bad), load_tokenizer=False)


def test_wrong_tp_size(tiny_engine_dir) -> None:
    with pytest.raises(ValueError, match="built for TP 2, not 1"):
        LLMEngine(EngineConfig(engine_dir=tiny_engine_dir("llama", tp=2)), load_tokenizer=False)


# values that pass validation and once overflowed the sampler (NaN probabilities: the step raised,
# the decode loop ended, the node went down with every stream on it)
def _extreme(**kw: float | int) -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, **kw)  # type: ignore[arg-type]


EXTREME = [
    _extreme(temperature=1e-40, seed=1),
    _extreme(temperature=4.9e-324, seed=1),
    _extreme(temperature=0.7, repetition_penalty=1e-40, seed=2, logprobs=3),
    _extreme(temperature=1e-6, repetition_penalty=1e-300, top_p=1e-40, seed=3),
    _extreme(temperature=1e30, repetition_penalty=1e30, top_k=2**40, seed=4, logprobs=20),
    _extreme(temperature=0.5, presence_penalty=2.0, frequency_penalty=-2.0, seed=5),
    _extreme(temperature=1.0, top_p=1e-300, seed=6),  # below fp32's range: every token was dropped (found by fuzzing)
    _extreme(temperature=1.0, top_p=1e-40, seed=7),
]


@pytest.mark.parametrize("params", EXTREME, ids=range(len(EXTREME)))
def test_extreme_sampling_values_are_served_beside_a_stream(engine: LLMEngine, params: SamplingParams) -> None:
    """Each finishes with finite log-probabilities while a greedy stream beside it yields exactly
    the tokens it yields alone; a temperature below MIN_TEMPERATURE samples the greedy tokens."""
    prompt, beside = [11, 12, 13, 14, 15], [7, 8, 9, 10]
    alone = engine.generate([beside], SamplingParams(max_tokens=8))[0]
    rid = engine.add_request(prompt, params)
    other = engine.add_request(beside, SamplingParams(max_tokens=8))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert len(engine.request(rid).output_ids) == 6
    assert list(engine.request(other).output_ids) == alone
    assert all(
        math.isfinite(lp.logprob) and all(map(math.isfinite, lp.top_logprobs)) for o in outs for lp in o.logprobs
    )
    if params.temperature < MIN_TEMPERATURE and not params.penalized:
        assert (
            list(engine.request(rid).output_ids)
            == engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        )
    assert engine.page_stats().used == 0


def test_a_failure_in_one_requests_sampling_fails_that_request_only(engine: LLMEngine, monkeypatch) -> None:
    """Whatever makes one request's distribution unsampleable (here: NaN probabilities for the
    request seeded 13), that request ends with an error naming it, its pages come back, and the
    step, the other streams and later requests go on with their own tokens."""
    real = sampling.probabilities

    def poisoned(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        out = real(logits, p)
        return torch.full_like(out, float("nan")) if p.seed == 13 else out

    others = [[7, 8, 9, 10], [3, 4, 5]]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    alone = engine.generate(others, params)
    monkeypatch.setattr(sampling, "probabilities", poisoned)
    bad = engine.add_request([11, 12, 13], SamplingParams(max_tokens=6, temperature=0.8, seed=13))
    ids = [engine.add_request(p, params) for p in others]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    failed = [o for o in outs if o.request_id == bad]
    assert len(failed) == 1 and failed[0].finish_reason is FinishReason.ERROR
    assert failed[0].error is not None and "sampling failed" in failed[0].error
    assert engine.request(bad).state is RequestState.FAILED
    assert [list(engine.request(i).output_ids) for i in ids] == alone
    assert engine.page_stats().used == 0


def test_a_request_that_would_outgrow_the_pool_ends_at_its_size(tiny_engine_dir) -> None:
    """16 pages of 4 tokens, and a request asking for 200 tokens past a 10-token prompt: alone it
    cannot be preempted into room, so it ends with "length" at the pool's 64 tokens (it was
    preempted by itself and recomputed without end); a request beside it keeps its tokens."""
    engine = tiny_engine(tiny_engine_dir("llama"), num_pages=16, page_size=4)
    big = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=200, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 400, "the request never finished"
    req = engine.request(big)
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 64
    small = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=5))
    assert len(small[0]) == 5 and engine.page_stats().used == 0

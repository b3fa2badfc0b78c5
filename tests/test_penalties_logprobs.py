"""Sampling controls against HF transformers (SmolLM2 fp32, same weights, greedy, 3 prompts x 32 tokens):
repetition penalty = HF's ``RepetitionPenaltyLogitsProcessor``; presence / frequency penalties = OpenAI's rule
as a logits processor over the generated tokens; log-probabilities = HF's log-softmax of the processed logits
(abs tolerance 2e-4: fp32, different kernels)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from tests.helpers import hf_greedy, smollm2_prompts, tiny_engine
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import InvalidRequestError, SamplingParams, apply_penalties
from torch_engine.tokenizer import Tokenizer

N = 32


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the tokens generated after the prompt."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[0, self.prompt_len :]
        if out.numel():
            counts = torch.bincount(out, minlength=scores.shape[-1]).to(scores.dtype)
            scores[0] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=128))


CASES: dict[str, tuple[dict[str, float], Callable[[int], list[LogitsProcessor]]]] = {
    "repetition": ({"repetition_penalty": 1.3}, lambda n: [RepetitionPenaltyLogitsProcessor(1.3)]),
    "presence": ({"presence_penalty": 1.5}, lambda n: [OpenAIPenalties(n, 1.5, 0.0)]),
    "frequency": ({"frequency_penalty": 0.8}, lambda n: [OpenAIPenalties(n, 0.0, 0.8)]),
    "none": ({}, lambda n: []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_penalties_and_logprobs_equals_hf(case: str, engine: LLMEngine, hf_smollm2, smollm2_dir) -> None:
    fields, processors = CASES[case]
    tok = engine.tokenizer
    assert tok is not None
    prompts = smollm2_prompts(tok)
    params = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2, **fields)  # type: ignore[arg-type]
    rids = [engine.add_request(p, params) for p in prompts]
    logprobs: dict[str, list[float]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs]
            pairs = zip(out.logprobs, out.new_token_ids, strict=True)
            assert all(len(lp.top_ids) == 2 and lp.top_ids[0] == t for lp, t in pairs)
    for rid, prompt in zip(rids, prompts, strict=True):
        req = engine.retire(rid)
        assert req is not None
        want, want_logps = hf_greedy(hf_smollm2, prompt, N, LogitsProcessorList(processors(len(prompt))))
        assert req.output_ids == want, case
        torch.testing.assert_close(torch.tensor(logprobs[rid]), torch.tensor(want_logps), atol=2e-4, rtol=0)


def test_penalties_change_the_output(engine: LLMEngine) -> None:
    """The penalties are applied at all: a repetitive prompt's greedy continuation differs with them on."""
    prompt = "one one one one one one one one one one"
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    penalised = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=2.0))[0]
    assert plain != penalised


def test_apply_penalties_by_hand() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [p], [([0], [1, 2, 2])])
    # token 0 (prompt): 2/2; token 1 (output once): -2*2 - 0.5 - 0.25; token 2 (output twice): 1/2 - 0.5 - 0.5
    assert logits.tolist() == [[1.0, -4.75, -0.5, 0.5]]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_sampling_controls_are_refused_by_name(fields: dict[str, float], name: str) -> None:
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**fields).validate()  # type: ignore[arg-type]


def test_prompt_logprobs_equal_hf_with_chunks_cache_and_preemption(smollm2_dir: Path, hf_smollm2) -> None:
    """``prompt_logprobs``: each prompt token's log-probability and top-3 = HF's log-softmax at the position
    before it; the same over 16-token prefill chunks, after the prompt's pages were cached (a scoring
    request computes its whole prompt), and in a pool so small that requests are preempted."""
    prompts = [p + p[1:] + p[1:] for p in smollm2_prompts(Tokenizer(smollm2_dir))]  # several chunks long
    with torch.no_grad():
        want = [torch.log_softmax(hf_smollm2(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    params = SamplingParams(max_tokens=16, prompt_logprobs=3, ignore_eos=True)  # decodes grow: preemption
    tight = max(-(-(len(p) + 16) // 16) for p in prompts) + 1  # room for the longest only: the others preempted
    for pages, chunk in ((256, 512), (256, 16), (tight, 16)):
        engine = tiny_engine(smollm2_dir, num_pages=pages, chunk=chunk, budget=max(chunk, 32), tokenizer=False)
        engine.generate(prompts, SamplingParams(max_tokens=1))  # the prompts' pages now cached
        rids = [engine.add_request(p, params) for p in prompts]
        firsts: dict[str, tuple] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.prompt_logprobs:
                    firsts[out.request_id] = out.prompt_logprobs
        for rid, p, lp in zip(rids, prompts, want, strict=True):
            got = firsts[rid]
            assert len(got) == len(p) and got[0] is None
            for j in range(1, len(p)):
                t = got[j]
                assert t is not None
                assert t.logprob == pytest.approx(float(lp[j - 1, p[j]]), abs=2e-4), (pages, chunk, j)
                top = torch.topk(lp[j - 1], 3)
                assert (
                    t.top_ids == tuple(top.indices.tolist())
                    or max(abs(a - b) for a, b in zip(t.top_logprobs, top.values.tolist(), strict=True)) < 2e-4
                )  # a tie may order the alternatives differently
        if pages == tight:
            assert engine.num_preemptions > 0


def test_logit_bias_and_min_tokens_equal_hf(engine: LLMEngine, hf_smollm2, smollm2_dir: Path) -> None:
    """``logit_bias`` is added to the logits (greedy then picks HF's argmax of logits + bias at every step);
    ``min_tokens`` holds EOS back: a prompt whose greedy answer ends at once runs to ``min_tokens`` first."""
    tok = Tokenizer(smollm2_dir)
    prompt = tok.encode("Answer with one word: what is the capital of France?", chat=True)
    plain = engine.generate([prompt], SamplingParams(max_tokens=16))[0]
    banned, boosted = plain[0], plain[1]
    bias = ((banned, -100.0), (boosted, 5.0))
    biased = engine.generate([prompt], SamplingParams(max_tokens=6, logit_bias=bias))[0]
    seq = list(prompt)
    with torch.no_grad():
        for got in biased:
            logits = hf_smollm2(torch.tensor([seq])).logits[0, -1].float()
            for t, b in bias:
                logits[t] += b
            assert got == int(logits.argmax())
            seq.append(got)
    assert biased[0] != banned
    eos = tok.eos_token_ids[0]
    assert eos in plain and len(plain) < 12  # the plain answer is short
    held = engine.generate([prompt], SamplingParams(max_tokens=24, min_tokens=12))[0]
    assert len(held) >= 12 and eos not in held[:12]
    assert held[: plain.index(eos)] == plain[: plain.index(eos)]  # the same until the EOS it held back

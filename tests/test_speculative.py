"""Speculative decoding (n-gram drafting) is lossless: greedy tokens equal plain decoding token for
token, sampled tokens keep the target distribution, and rejected positions give their pages back."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import engine_config, prompt_of, speculating_engine
from torch_engine.config import KVLayout, SpecMethod, SpeculativeConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams
from torch_engine.speculative import NgramDrafter, rejection_sample, verify_greedy
from torch_engine.speculator import Speculator

NGRAM = SpeculativeConfig(method=SpecMethod.NGRAM, num_tokens=4)


def engine(
    engine_dir: Path, spec: SpeculativeConfig | None = NGRAM, speculator: Speculator | None = None, **kw: Any
) -> LLMEngine:
    return speculating_engine(engine_dir, spec, speculator, **kw)


def repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats a phrase: the n-gram drafter finds what comes next."""
    phrase = prompt_of(7, seed)
    return (phrase * (n // 7 + 1))[:n]


# -- the pieces -------------------------------------------------------------------------------


def test_ngram_drafter_proposes_what_followed_the_latest_match() -> None:
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # "1 2 3" was followed by "9 1"
    assert d.propose([5, 1, 2, 7, 1, 2], 3) == [7, 1, 2]
    assert d.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert d.propose([4, 4, 4, 4], 2) == [4]  # the latest match leaves one token after it
    assert d.propose([1, 2, 1], 0) == []


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == 2
    assert verify_greedy([5, 6, 7, 8], [1, 6, 7]) == 0
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == 3


def test_rejection_sampling_accepts_exactly_what_the_maths_says() -> None:
    g = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    assert all(rejection_sample(certain, [1], g)[0] == 1 for _ in range(200))  # p(d) = 1: always accepted
    impossible = torch.tensor([[0.6, 0.0, 0.4], [1.0, 0.0, 0.0]])
    for _ in range(200):  # p(d) = 0: always rejected, and the replacement is never d
        n, t = rejection_sample(impossible, [1], g)
        assert n == 0 and t != 1
    # p(d) = 0.3: accepted 30% of the time; the emitted token is distributed as p (0.5 / 0.3 / 0.2)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    trials = 20000
    runs = [rejection_sample(p, [1], g) for _ in range(trials)]
    accepted = sum(n for n, _ in runs) / trials
    sigma = math.sqrt(0.3 * 0.7 / trials)
    assert abs(accepted - 0.3) < 5 * sigma
    first = Counter(1 if n == 1 else t for n, t in runs)  # the first emitted token
    for token, want in enumerate([0.5, 0.3, 0.2]):
        assert abs(first[token] / trials - want) < 5 * math.sqrt(want * (1 - want) / trials)
    bonus = Counter(t for n, t in runs if n == 1)  # after an acceptance the bonus comes from p_1
    n_bonus = sum(bonus.values())
    assert abs(bonus[2] / n_bonus - 0.8) < 5 * math.sqrt(0.8 * 0.2 / n_bonus)


# -- in the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "layout"), [("llama", KVLayout.HND), ("llama", KVLayout.NHD), ("deepseek_v3", None)])
def test_greedy_with_speculation_equals_without(kind: str, layout: KVLayout | None, tiny_engine_dir) -> None:
    prompts = [repetitive(40, 1), prompt_of(23, 2), repetitive(61, 3), prompt_of(5, 4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    kw: dict[str, Any] = {"kv_layout": layout} if layout is not None else {}
    plain = engine(tiny_engine_dir(kind), spec=None, **kw).generate(prompts, params)
    spec = engine(tiny_engine_dir(kind), **kw)
    assert spec.generate(prompts, params) == plain
    stats = spec.spec_stats
    assert stats.accepted > 0 and stats.proposed > stats.accepted  # drafts were accepted, and rejected
    assert spec.page_stats().used == 0


def test_per_request_opt_in_mixed_with_chunked_prefill(tiny_engine_dir) -> None:
    """One batch: speculating requests, requests that opted out, and long prompts still prefilling
    in chunks; every request's tokens equal plain decoding."""
    eng = engine(tiny_engine_dir("llama"), spec=SpeculativeConfig(method=SpecMethod.NGRAM, num_tokens=3, default=False))
    plain = engine(tiny_engine_dir("llama"), spec=None)
    prompts = [repetitive(30, 5), repetitive(30, 6), prompt_of(90, 7), prompt_of(70, 8)]
    opts = [True, None, True, False]  # None: the engine's default (off here)
    ids = [
        eng.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True, speculate=o))
        for p, o in zip(prompts, opts, strict=True)
    ]
    pages_ok = True
    while eng.has_unfinished():
        eng.step()
        for rid in ids:  # rejected positions give their pages back: never more than the tokens need
            r = eng.request(rid)
            if r.pages:
                pages_ok &= len(r.pages) <= -(-(r.num_tokens) // eng.describe().page_size)
    want = plain.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [eng.request(i).output_ids for i in ids] == want
    assert pages_ok
    stats = [eng.request(i).spec for i in ids]
    assert stats[0].proposed > 0 and stats[2].steps >= 0
    assert stats[1].proposed == 0 and stats[3].proposed == 0  # opted out: never drafted
    assert eng.page_stats().used == 0


def test_penalised_requests_do_not_speculate(tiny_engine_dir) -> None:
    eng = engine(tiny_engine_dir("llama"))
    params = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    rid = eng.add_request(repetitive(30, 9), params)
    while eng.has_unfinished():
        eng.step()
    assert eng.request(rid).spec.proposed == 0
    assert (
        eng.request(rid).output_ids
        == engine(tiny_engine_dir("llama"), spec=None).generate([repetitive(30, 9)], params)[0]
    )


def test_sampled_tokens_keep_their_distribution(tiny_engine_dir) -> None:
    """Two-sample chi-square test on (1st, 2nd) sampled tokens (top-k 3: at most 9 outcomes) of 600
    seeded requests each, with and without speculation, on a prompt ending in the model's own greedy
    loop (so that drafts are often accepted). The statistic is compared with the chi-square 0.999
    quantile: a correct sampler fails this test about once in a thousand runs (and with these fixed
    seeds, never)."""
    base = prompt_of(8, 3)
    prompt = (
        base
        + engine(tiny_engine_dir("llama"), spec=None).generate([base], SamplingParams(max_tokens=60, ignore_eos=True))[
            0
        ]
    )
    params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=3, seed=s, ignore_eos=True) for s in range(600)]

    def outcomes(spec: SpeculativeConfig | None) -> tuple[Counter[tuple[int, int]], LLMEngine]:
        eng = engine(tiny_engine_dir("llama"), spec=spec)
        ids = [eng.add_request(prompt, p) for p in params]
        while eng.has_unfinished():
            eng.step()
        return Counter(tuple(eng.request(i).output_ids[:2]) for i in ids), eng  # type: ignore[misc]

    plain, _ = outcomes(None)
    spec, eng = outcomes(NGRAM)
    assert eng.spec_stats.accepted > 50  # speculation really took part
    cats = sorted(set(plain) | set(spec))
    n1, n2 = sum(plain.values()), sum(spec.values())
    stat = 0.0
    for c in cats:
        a, b = plain[c], spec[c]
        expected_a, expected_b = (a + b) * n1 / (n1 + n2), (a + b) * n2 / (n1 + n2)
        stat += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    dof = len(cats) - 1
    quantile_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}[dof]
    assert stat < quantile_999, (stat, plain, spec)


def test_smollm2_greedy_with_ngram_speculation_equals_without(smollm2_dir: Path) -> None:
    from torch_engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompts = [
        tok.encode("List the numbers from 1 to 40, separated by commas: 1, 2, 3, 4, 5,"),
        tok.encode("Why is the sky blue?", chat=True),
        tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = LLMEngine(engine_config(smollm2_dir, num_pages=128), load_tokenizer=False).generate(prompts, params)
    spec = LLMEngine(engine_config(smollm2_dir, num_pages=128, speculative=NGRAM), load_tokenizer=False)
    got = []
    for p in prompts:  # one at a time: each request's acceptance is its own
        rid = spec.add_request(p, params)
        while spec.has_unfinished():
            spec.step()
        got.append(spec.request(rid))
    assert [r.output_ids for r in got] == plain
    assert got[0].spec.accepted >= 10  # the counting prompt repeats itself: drafts are accepted
    print("smollm2 n-gram acceptance:", [f"{r.spec.accepted}/{r.spec.proposed}" for r in got])


def test_no_drafting_above_the_batch_limit(tiny_engine_dir) -> None:
    limited = SpeculativeConfig(method=SpecMethod.NGRAM, num_tokens=4, max_batch=1)
    eng = engine(tiny_engine_dir("llama"), spec=limited)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    two = [eng.add_request(repetitive(30, s), params) for s in (1, 2)]
    while eng.has_unfinished():
        eng.step()
    assert all(eng.request(i).spec.proposed == 0 for i in two)  # two running: no drafts
    one = eng.add_request(repetitive(30, 1), params)
    while eng.has_unfinished():
        eng.step()
    assert eng.request(one).spec.proposed > 0
    assert eng.request(one).output_ids == eng.request(two[0]).output_ids

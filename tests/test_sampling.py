"""The sampler's filters, checked against their definitions on hand-made distributions."""

from __future__ import annotations

import math

import torch

from torch_engine.sampling import SamplerState, SamplingParams, sample


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    state = SamplerState.seeded(0)
    return {sample(logits[None], [params], [state])[0] for _ in range(n)}


def test_greedy_takes_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [SamplerState(), SamplerState()]) == [1, 0]


def test_top_k_limits_support() -> None:
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
    assert draws(logits, SamplingParams(temperature=1.0, top_k=2)) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.5)) == {0}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.81)) == {0, 1, 2}


def test_temperature_sharpens() -> None:
    logits = torch.tensor([math.log(0.6), math.log(0.4)])
    state = SamplerState.seeded(1)
    cold = [sample(logits[None], [SamplingParams(temperature=0.05)], [state])[0] for _ in range(200)]
    assert cold.count(0) > 195


def test_seed_reproducible() -> None:
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0)
    a = [sample(logits, [p], [s])[0] for s in [SamplerState.seeded(5)] for _ in range(20)]
    b = [sample(logits, [p], [s])[0] for s in [SamplerState.seeded(5)] for _ in range(20)]
    assert a == b

"""Sampling parameters (validated at the API boundary) and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the offending field and value."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class SamplerState:
    """Per-request random state: a generator seeded from the request's seed."""

    generator: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def seeded(cls, seed: int) -> SamplerState:
        g = torch.Generator()
        g.manual_seed(seed)
        return cls(g)


def sample(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState]) -> list[int]:
    """One token per row of ``logits`` (``[S, V]``)."""
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].cpu() / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=states[i].generator).item())
    return out

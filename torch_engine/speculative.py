"""Speculative decoding: drafters propose tokens, one forward pass verifies them, losslessly.

A request that speculates gets, in one step, its next token plus up to ``k`` draft tokens as one
chunk (the chunked-prefill path runs several tokens of one request with a causal mask); the model
returns the logits of every position of the chunk, and:

- greedy: the longest prefix of the draft equal to the target's argmax at each position is
  accepted, plus the target's own next token (so every step emits 1..k+1 tokens, exactly the
  tokens plain greedy decoding emits);
- sampled: the draft is a point mass q (n-gram drafting is deterministic), so draft token d at
  position i is accepted with probability min(1, p_i(d) / q(d)) = p_i(d); on the first rejection
  the token is drawn from the residual max(0, p_i - q) renormalised (p_i without d); if every
  draft token is accepted a bonus token is drawn from p_k. Each emitted token is distributed
  exactly as the target's (Leviathan et al. 2023; Chen et al. 2023), with p_i the distribution
  plain sampling draws from (temperature, top-k, top-p: ``sampling.probabilities``).

KV written for rejected positions is simply not counted (``num_computed`` stops after the last
accepted token) and pages past the new end are returned (``Scheduler.trim``). ``k`` is fixed per
deployment (``SpeculativeConfig.num_tokens``), shortened where the step budget, free pages, the
context or ``max_tokens`` leave less room; how often a request drafts adapts: after drafts that
were wholly rejected it backs off exponentially (``SpecStats.backoff``), and after
``give_up_after`` such drafts in a row it stops speculating (drafting that does not pay for this
text costs nothing from then on; with MTP its MTP pass stops too). Requests with penalties
do not speculate (their logits depend on the tokens a draft would add).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class NgramDrafter:
    """Prompt-lookup drafting (vLLM's ``ngram``): find the latest earlier occurrence of the last
    ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) and propose the tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every n-gram but the suffix itself
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest occurrence: what followed it
                return [int(t) for t in arr[start : start + k]]
        return []


def verify_greedy(target: Sequence[int], draft: Sequence[int]) -> int:
    """How many draft tokens the target's argmax tokens (``target[i]`` follows position i of the
    chunk) confirm: the draft's longest prefix with ``draft[i] == target[i]``."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def rejection_sample(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator) -> tuple[int, int]:
    """``probs``: ``[k + 1, V]`` target distributions at each position of the chunk; ``draft``: the
    ``k`` proposed tokens (a point-mass draft). Returns (accepted draft tokens, the next token)."""
    for i, d in enumerate(draft):
        p = probs[i]
        if float(torch.rand((), generator=generator)) < float(p[d]):
            continue
        residual = p.clone()
        residual[d] = 0.0
        mass = float(residual.sum())
        if mass <= 0.0:  # p is a point mass at d (rounding made p[d] a hair below 1): d it is
            continue
        return i, int(torch.multinomial(residual / mass, 1, generator=generator).item())
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator).item())


@dataclass(slots=True)
class SpecStats:
    """Draft tokens proposed and accepted (per request, and per engine)."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # steps in which a draft was verified
    misses: int = 0  # consecutive verified drafts with nothing accepted
    skip: int = 0  # steps to decode without drafting (back-off after misses)

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1

    def backoff(self, accepted: int) -> None:
        """After m drafts in a row with nothing accepted, skip 2**m - 1 steps (at most 15); any
        accepted token resets it. Wasted verification on text that does not repeat stays small."""
        self.misses = 0 if accepted else self.misses + 1
        self.skip = min(2**self.misses, 16) - 1 if self.misses else 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

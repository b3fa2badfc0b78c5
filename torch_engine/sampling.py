"""Sampling parameters (validated at the API boundary) and the batched sampler.

No accepted value can make the sampler produce NaN or inf (a request that did took its decode node
down): every float must be finite; a temperature below ``MIN_TEMPERATURE`` samples greedily (as
vLLM does with its sampling epsilon; the distribution is a point mass at that scale anyway);
penalised logits, and logits divided by the temperature, are clamped to the finite fp32 range, so
no softmax sees inf - inf (the largest logit minus itself is 0; the others underflow to 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType

import torch

from torch_engine.guided import Guide, GuideError, check_guide

MIN_TEMPERATURE = 1e-5  # below it a request samples greedily
_FP32_MAX = torch.finfo(torch.float32).max


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the offending field and value (``param``:
    the field's name, where one field is to blame)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    repetition_penalty: float = 1.0  # > 1 discourages every token already in the prompt or output (HF / TRT-LLM)
    presence_penalty: float = 0.0  # subtracted once from each token already generated (OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token already generated (OpenAI)
    logprobs: int | None = None  # None: none; k: the sampled token's log-probability and the top k alternatives
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's log-probability and top k (vLLM's)
    speculate: bool | None = None  # None: the engine's default (``SpeculativeConfig.default``)
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share KV pages
    guide: Guide | None = None  # constrained decoding: the output follows this schema / grammar (``guided.py``)
    min_tokens: int = 0  # EOS and stop token ids are not sampled before this many tokens (vLLM's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit (OpenAI's)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not isinstance(getattr(self, name), int | float) or not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT
        ):
            raise InvalidRequestError(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", "cache_salt"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k!r}", name)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}", "min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(
            not isinstance(t, int) or t < 0 or not isinstance(b, int | float) or not -100 <= b <= 100
            for t, b in self.logit_bias
        ):
            raise InvalidRequestError(
                f"logit_bias holds at most {MAX_LOGIT_BIAS} token ids >= 0, each with a bias in [-100, 100]",
                "logit_bias",
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids) or len(self.stop_token_ids) > 64:
            raise InvalidRequestError("stop_token_ids holds at most 64 token ids >= 0", "stop_token_ids")
        if self.guide is not None:
            try:
                check_guide(self.guide)
            except GuideError as exc:
                raise InvalidRequestError(str(exc), "guide") from None

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below ``MIN_TEMPERATURE`` (a point mass at the argmax at that scale)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biased(self) -> bool:
        """Its logits are shifted (``logit_bias``) or its stop tokens held back (``min_tokens``)."""
        return bool(self.logit_bias) or self.min_tokens > 0


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_CACHE_SALT = 256


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability and its top alternatives (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(slots=True)
class SamplerState:
    """Per-request random state: a generator seeded from the request's seed."""

    generator: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def seeded(cls, seed: int) -> SamplerState:
        g = torch.Generator()
        g.manual_seed(seed)
        return cls(g)


def apply_biases(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[int], stop_ids: frozenset[int]
) -> None:
    """``logit_bias`` added to each row's logits (``[S, V]``, in place), and, while a row has generated
    fewer than ``min_tokens`` (``outputs``: how many it has), its EOS / stop token ids set to -inf."""
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            if token < vocab:
                logits[i, token] += bias
        if outputs[i] < p.min_tokens:
            banned = [t for t in (*stop_ids, *p.stop_token_ids) if t < vocab]
            logits[i, banned] = float("-inf")


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """Penalise ``logits`` (``[S, V]``, fp32, in place) by each row's (prompt, output) history.

    Repetition (HF ``RepetitionPenaltyLogitsProcessor``, TensorRT-LLM): each token seen in the prompt or
    output has its logit divided by the penalty when positive, multiplied when negative. Presence and
    frequency (OpenAI): each token generated so far loses ``presence + frequency * count``.
    """
    for i, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        if not p.penalized:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(values < 0, values * p.repetition_penalty, values / p.repetition_penalty)
        if output and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.unique(torch.tensor(output, dtype=torch.long, device=row.device), return_counts=True)
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)
        row.clamp_(-_FP32_MAX, _FP32_MAX)  # a tiny repetition penalty overflows a logit to inf
    return logits


def logprobs_of(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Log-softmax of each row (``[S, V]``, after penalties, before temperature / top-k / top-p) at its token."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for i, (token, k) in enumerate(zip(tokens, ks, strict=True)):
        top = torch.topk(logp[i], k) if k else None
        out.append(
            TokenLogprobs(
                float(logp[i, token]),
                tuple(int(t) for t in top.indices.tolist()) if top is not None else (),
                tuple(float(v) for v in top.values.tolist()) if top is not None else (),
            )
        )
    return out


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: ``logits`` (``[..., V]``) / temperature,
    then top-k, then top-p (the smallest prefix reaching ``top_p``), softmax."""
    rows = (logits.float().cpu() / p.temperature).clamp(-_FP32_MAX, _FP32_MAX)  # inf -> the largest finite
    if p.top_k and p.top_k < rows.shape[-1]:
        kth = torch.topk(rows, p.top_k, dim=-1).values[..., -1:]
        rows = rows.masked_fill(rows < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(rows, descending=True, dim=-1)
        soft = sorted_logits.softmax(-1)
        drop = soft.cumsum(-1) - soft >= p.top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # and always the top token (a top_p below fp32's range compares as 0)
        rows = rows.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return rows.softmax(-1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    states: list[SamplerState],
    failures: dict[int, str] | None = None,
    kernels: ModuleType | None = None,
) -> list[int]:
    """One token per row of ``logits`` (``[S, V]``). With ``failures``, a row whose sampling fails
    gets -1 and its reason there (that request fails; the other rows are sampled as usual);
    without, the failure is raised. ``kernels``: the CPU kernels, whose ``argmax_rows`` is
    ``torch.argmax`` in one vector pass (PyTorch's takes ~1 ns a value on the CPU)."""
    logits = logits.float()
    if kernels is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0:
        out = kernels.argmax_rows(logits).tolist()
    else:
        out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            probs = probabilities(logits[i], p)
            out[i] = int(torch.multinomial(probs, 1, generator=states[i].generator).item())
        except RuntimeError as exc:  # torch's error for a distribution it cannot sample
            if failures is None:
                raise
            out[i], failures[i] = -1, f"sampling failed: {exc}"
    return out

"""A request's lifecycle.

States (ordered; everything >= FINISHED is terminal and holds no pages):

    WAITING ──admit──> RUNNING ──sampled stop / max_tokens──> FINISHED
       ^                 │ └──prefill-only, KV of [0, n-1) written──> PREFILLED ──release──> FINISHED
       └──preempted──────┘
    WAITING_FOR_KV ──kv_ready──> RUNNING        (decode half of a split request)
    any non-terminal ──abort──> ABORTED ; ──kv_failed / error──> FAILED

A RUNNING request has ``num_computed`` tokens of KV in its pages; each step computes the next
chunk of ``all_tokens[num_computed:]``. A request with exactly one uncomputed token is decoding.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from torch_engine.guided import GrammarState
from torch_engine.sampling import SamplerState, SamplingParams, TokenLogprobs
from torch_engine.speculative import SpecStats


class RequestState(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_KV = 1
    RUNNING = 2
    PREFILLED = 3
    FINISHED = 4
    ABORTED = 5
    FAILED = 6


class RequestKind(enum.IntEnum):
    GENERATE = 0  # prefill and decode here (colocated)
    PREFILL_ONLY = 1  # KV of prompt tokens [0, n-1); nothing sampled
    DECODE_FROM_KV = 2  # KV of [0, n-1) arrives in reserved pages; starts by running token n-1


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    PREFILLED = 4


@dataclass(slots=True, kw_only=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kind: RequestKind
    sampler: SamplerState
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    want_last_hidden: bool = False
    last_hidden: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None
    text: str = ""  # detokenised output (kept when stop strings are in use)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)  # draft tokens proposed / accepted
    mtp_draft: int | None = None  # the MTP module's draft for position ``mtp_draft_at``
    mtp_draft_at: int = -1
    prefill_hidden: torch.Tensor | None = None  # split request: the prefill's last hidden state (MTP's first draft)
    # prefix cache (``prefix_cache.py``)
    cached_tokens: int | None = None  # prompt tokens whose KV was reused, at first admission (None: not yet)
    cache_keys: list[bytes] = field(default_factory=list)  # content keys of its first pages
    cache_registered: int = 0  # its first pages that are cached (filed by it, or hits)
    mtp_kv_gap: bool = False  # the MTP draft pass skipped some of its positions
    grammar: GrammarState | None = None  # its guide's matcher, where it samples (``guided.py``)
    prompt_lps: list[TokenLogprobs | None] = field(default_factory=list)  # per prompt token (the first: None)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def compute_target(self) -> int:
        """How many tokens need KV before this request next yields something."""
        if self.kind is RequestKind.PREFILL_ONLY:
            return len(self.prompt_ids) - 1
        return self.num_tokens

    @property
    def finished(self) -> bool:
        return self.state >= RequestState.FINISHED


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of ``prompt_tokens``, reused from the prefix cache (no KV computed or moved)
    text_window: tuple[int, ...] = ()  # tokens whose decoding, past ``text_skip`` of them, is ``text``
    text_skip: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()  # of ``new_token_ids``, when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # of every prompt token (None for the first): on the
    # output that carries the first generated token, when the request asked for them
    drafts: tuple[int, int] = (0, 0)  # the request's draft tokens so far: (proposed, accepted)

"""Continuous batching with chunked prefill under a per-step token budget.

Queues:
    waiting   deque  admitted in arrival order when the pages for its next chunk can be allocated;
                     one that cannot get them is passed by later ones that can (looking at most
                     ``BYPASS_SCAN`` past it) until it has been blocked ``head_of_line_steps``
                     steps: from then on nothing passes it (no starvation)
    running   list   has pages; each step gets a decode token or the next prefill chunk
    kv_wait   dict   WAITING_FOR_KV: pages reserved and pinned, KV arriving from elsewhere
    prefilled dict   PREFILLED: prefill-only requests whose pages await ``release``

Each step: running decodes first (one token each), then running prefills, then new admissions,
until the token budget or ``max_num_seqs`` is used. A request admitted from ``waiting`` first takes
the longest cached prefix of its tokens (``prefix_cache.py``: shared pages, never written) and
computes from there; the rest of its prompt but the last token, where a running request holds it
in a page, is copied from that page into one of its own (``SchedulerOutput.copies``). Pages are
allocated per chunk; when they run out, the newest running request without pinned pages is
preempted (its pages freed, cached ones kept while the pool allows; it is recomputed later, from
its cached prefix). A request that cannot get pages waits; nothing crashes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from torch_engine.pages import PageAllocator
from torch_engine.prefix_cache import PrefixCache
from torch_engine.request import FinishReason, Request, RequestKind, RequestState

BYPASS_SCAN = 4  # blocked waiting requests a later one may pass in one step

# speculative decoding: (request, room, running requests) -> up to ``room`` draft tokens for a
# request about to sample (``Speculator.propose``)
Propose = Callable[[Request, int, int], list[int]]


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start: int  # position of the first token computed in this step
    length: int  # tokens computed, draft tokens included
    draft: tuple[int, ...] = ()  # speculative tokens after the request's next token (verified this step)

    @property
    def completes(self) -> bool:
        return self.start + self.length - len(self.draft) == self.request.compute_target

    @property
    def samples(self) -> bool:
        return self.completes and self.request.kind is not RequestKind.PREFILL_ONLY

    @property
    def scores_prompt(self) -> bool:
        """Its rows predict prompt tokens whose log-probabilities the request asked for."""
        req = self.request
        return req.params.prompt_logprobs is not None and self.start < len(req.prompt_ids) - 1

    @property
    def outputs(self) -> int:
        """How many of its last rows the step needs the final hidden state / logits of: every row of
        a draft chunk or of a chunk that scores the prompt; else the last one, if the chunk samples
        or its final hidden state is wanted."""
        if self.draft or self.scores_prompt:
            return self.length
        return int(self.samples or (self.completes and self.request.want_last_hidden))


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) pages, copied in
    # order by every rank before the step's forward pass: a shared prompt's partial last page

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_chunk: int,
        propose: Propose | None = None,
        cache: PrefixCache | None = None,
        head_of_line_steps: int = 0,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_chunk = max_prefill_chunk
        self.propose = propose
        self.cache = cache
        self.head_of_line_steps = head_of_line_steps
        self._blocked_since: dict[str, int] = {}  # waiting request -> the step it was first refused pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.kv_wait: dict[str, Request] = {}
        self.prefilled: dict[str, Request] = {}
        self.steps = 0
        self.num_preemptions = 0

    # -- queue changes -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_reserve(self, num_tokens: int, hit: list[int]) -> bool:
        """Pages for ``num_tokens`` of KV can be reserved, ``hit`` (cached pages of the first tokens) shared."""
        return self.allocator.can_allocate(self.pages_for(num_tokens) - len(hit) + self.allocator.revivals(hit))

    def reserve(self, req: Request, num_tokens: int, hit: list[int]) -> None:
        """Share ``hit`` and allocate the rest of the pages for ``num_tokens`` of KV, which a remote
        prefill writes (past the hit); those pinned while the request waits for its KV (the shared
        cached pages are never written, so never pinned: their other holders stay preemptible)."""
        self.allocator.share(hit)
        req.pages = hit + self.allocator.allocate(self.pages_for(num_tokens) - len(hit))
        req.cache_registered = len(hit)
        req.cached_tokens = len(hit) * self.page_size
        if self.cache is not None:
            self.cache.count(req, req.cached_tokens)
        self.allocator.pin(req.pages[len(hit) :])
        req.state = RequestState.WAITING_FOR_KV
        self.kv_wait[req.request_id] = req

    def replace_reserved(self, req: Request) -> None:
        """New pages past the request's cached prefix (the old ones are freed: deferred while a
        transport pins them)."""
        h, n = req.cache_registered, len(req.prompt_ids) - 1
        old = req.pages[h:]
        fresh = self.allocator.allocate(self.pages_for(n) - h)
        self.allocator.pin(fresh)
        req.pages = req.pages[:h] + fresh
        self.allocator.unpin(old)
        self.allocator.free(old)

    def load(self) -> tuple[int, float, int]:
        """What is on hand: decoding requests, their mean context, prompt tokens still to prefill."""
        prefilling = [r for r in (*self.waiting, *self.running) if not r.output_ids]
        pending = sum(r.compute_target - r.num_computed for r in prefilling)
        decoding = [r for r in self.running if r.output_ids]
        context = sum(r.num_tokens for r in decoding) / len(decoding) if decoding else 0.0
        return len(decoding), context, pending

    def kv_ready(self, req: Request) -> None:
        del self.kv_wait[req.request_id]
        self.allocator.unpin(req.pages[req.cache_registered :])
        req.num_computed = len(req.prompt_ids) - 1
        req.state = RequestState.RUNNING
        self.running.append(req)
        self.computed(req)

    def computed(self, req: Request) -> None:
        """``req``'s ``num_computed`` moved: pages whose KV is now complete join the prefix cache."""
        if self.cache is not None:
            self.cache.register(req)

    def mark_prefilled(self, req: Request) -> None:
        self.running.remove(req)
        req.state = RequestState.PREFILLED
        self.prefilled[req.request_id] = req

    def finish(self, req: Request, state: RequestState, reason: FinishReason, error: str | None = None) -> None:
        """Take ``req`` out of every queue and free its pages (pinned ones when unpinned)."""
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
            self._blocked_since.pop(req.request_id, None)
        elif req.state is RequestState.RUNNING:
            self.running.remove(req)
        elif req.state is RequestState.WAITING_FOR_KV:
            del self.kv_wait[req.request_id]
            # the reservation's own pin (past the shared prefix); a transport's pins defer the free
            self.allocator.unpin(req.pages[req.cache_registered :])
        elif req.state is RequestState.PREFILLED:
            del self.prefilled[req.request_id]
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        req.state, req.finish_reason, req.error = state, reason, error

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        for req in sorted(self.running, key=lambda r: r.compute_target - r.num_computed > 1):
            if budget == 0 or len(chunks) >= self.max_num_seqs:
                break
            if req.state is not RequestState.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.compute_target - req.num_computed, budget, self.max_chunk)
            if not self._grow(req, req.num_computed + n, protect=scheduled):
                continue
            draft = self._draft(req, n, budget)
            chunks.append(ScheduledChunk(req, req.num_computed, n + len(draft), draft))
            scheduled.add(req.request_id)
            budget -= n + len(draft)
        copies: list[tuple[int, int]] = []
        self._admit(chunks, budget, copies)
        self.steps += 1
        return SchedulerOutput(self.steps, chunks, copies)

    def tail(self, req: Request, hit: list[int]) -> tuple[int, int] | None:
        """A running (or prefilled) request's page holding ``req``'s tokens past ``hit``: ``PrefixCache.tail``."""
        if self.cache is None:
            return None
        return self.cache.tail(req, hit, (*self.running, *self.prefilled.values()))

    def reused(self, req: Request, hit: list[int]) -> int:
        """Prompt tokens ``req`` would not compute: ``hit``'s and a running request's copy of the rest."""
        tail = self.tail(req, hit)
        return len(hit) * self.page_size + (tail[1] if tail is not None else 0)

    def _admit(self, chunks: list[ScheduledChunk], budget: int, copies: list[tuple[int, int]]) -> None:
        """Admit waiting requests whose next chunk gets pages, in arrival order; one refused pages is
        passed (up to ``BYPASS_SCAN`` of them) unless it has been refused for ``head_of_line_steps``."""
        i = passed = 0
        while i < len(self.waiting) and budget > 0 and len(chunks) < self.max_num_seqs:
            req = self.waiting[i]
            chunk = self._start(req, budget, copies)
            if chunk is None:  # no pages for its next chunk
                since = self._blocked_since.setdefault(req.request_id, self.steps)
                if self.steps - since >= self.head_of_line_steps or passed == BYPASS_SCAN:
                    break  # it has waited long enough: nothing behind it goes first
                i, passed = i + 1, passed + 1
                continue
            del self.waiting[i]
            self._blocked_since.pop(req.request_id, None)
            chunks.append(chunk)
            budget -= chunk.length

    def _start(self, req: Request, budget: int, copies: list[tuple[int, int]]) -> ScheduledChunk | None:
        """Give a waiting request its cached prefix (and a running one's copy of the rest of its prompt)
        and pages for its next chunk (None: not enough)."""
        hit = self.cache.match(req) if self.cache is not None else []
        tail = self.tail(req, hit)
        start = len(hit) * self.page_size + (tail[1] if tail is not None else 0)
        n = min(req.compute_target - start, budget, self.max_chunk)
        need = self.pages_for(start + n) - len(hit)
        if not self.allocator.can_allocate(need + self.allocator.revivals(hit)):
            return None  # admission control: wait for pages
        self.allocator.share(hit)  # before allocating: a hit page is never the one evicted
        req.pages = hit + self.allocator.allocate(need)
        if tail is not None:  # its holder's page is held: not evicted by the allocation above
            copies.append((tail[0], req.pages[len(hit)]))
        req.num_computed, req.cache_registered = start, len(hit)
        if req.cached_tokens is None:
            req.cached_tokens = start
            if self.cache is not None:
                self.cache.count(req, start)
        req.state = RequestState.RUNNING
        self.running.append(req)
        return ScheduledChunk(req, start, n)

    def _draft(self, req: Request, n: int, budget: int) -> tuple[int, ...]:
        """Draft tokens for a request whose chunk samples: as many as the budget and the free pages
        allow without preempting anyone (drafts are a bet, not a right)."""
        if self.propose is None or n != 1 or req.compute_target - req.num_computed != 1:
            return ()
        if req.kind is RequestKind.PREFILL_ONLY:
            return ()
        room = min(budget - n, self.max_chunk - n)
        draft = self.propose(req, room, len(self.running)) if room > 0 else []
        while draft and not self.allocator.can_allocate(
            self.pages_for(req.num_computed + 1 + len(draft)) - len(req.pages)
        ):
            draft.pop()
        need = self.pages_for(req.num_computed + 1 + len(draft)) - len(req.pages)
        if draft and need > 0:
            req.pages += self.allocator.allocate(need)
        return tuple(draft)

    def trim(self, req: Request) -> None:
        """Return pages past what the request's tokens need (after rejected draft positions)."""
        keep = self.pages_for(req.num_tokens)
        if req.state is RequestState.RUNNING and len(req.pages) > keep:
            extra, req.pages = req.pages[keep:], req.pages[:keep]
            self.allocator.free(extra)

    def _grow(self, req: Request, num_tokens: int, protect: set[str]) -> bool:
        need = self.pages_for(num_tokens) - len(req.pages)
        while not self.allocator.can_allocate(need):
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if r is not req and r.request_id not in protect and not self._pinned(r)
                ),
                None,
            )
            if victim is None:
                if not self._pinned(req):  # pinned pages are being transferred: wait, never recompute
                    self._preempt(req)
                return False
            self._preempt(victim)
        if need > 0:
            req.pages += self.allocator.allocate(need)
        return True

    def _pinned(self, req: Request) -> bool:
        return any(self.allocator.is_pinned(p) for p in req.pages)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed = req.cache_registered = 0
        req.state = RequestState.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

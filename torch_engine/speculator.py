"""The engine's speculative-decoding room: who drafts, what they propose, how a step's drafts are
verified, and the MTP passes that draft the next step's token (the method: ``speculative.py``).

``LLMEngine`` takes a ``Speculator`` at construction (``Speculator(config.speculative, ...)`` by
default); the scheduler asks it for drafts (``propose``) while it builds a step, the step verifies
them (``verify``), and after the step's tokens are chosen ``draft_pass`` runs the MTP module where
the model has one. A split request whose KV landed with the prefill's last hidden state is
``seed``-ed: its first step then verifies a draft made from that state (``seed_drafts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torch_engine.config import SpecMethod, SpeculativeConfig
from torch_engine.request import Request, RequestKind, RequestState
from torch_engine.sampling import TokenLogprobs, logprobs_of, probabilities
from torch_engine.speculative import NgramDrafter, SpecStats, rejection_sample, verify_greedy
from torch_engine.steps import DraftInputs, Span

if TYPE_CHECKING:
    from torch_engine.model_runner import ModelRunner
    from torch_engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(slots=True)
class Picked:
    """What a sampling chunk emits this step: tokens (its next one, after any accepted drafts)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    error: str | None = None  # this request's sampling failed (it fails; the step goes on)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        ngram = config.method is SpecMethod.NGRAM
        self._drafter = NgramDrafter(config.ngram_max, config.ngram_min) if ngram else None
        self.mtp = config.method is SpecMethod.MTP  # drafts with the model's MTP module
        self.stats = SpecStats()  # draft tokens proposed / accepted by this engine
        self._seeds: list[Request] = []  # split requests whose first draft comes from the prefill's hidden state

    @property
    def drafts(self) -> bool:
        """Some request may draft (the scheduler asks ``propose``)."""
        return self._drafter is not None or self.mtp

    def may_draft(self, req: Request) -> bool:
        """The request speculates: it opted in (or left it to the default), has no penalties, logit
        bias or min_tokens (its logits would depend on the tokens a draft adds, or drafts are verified
        on the raw logits), and has not given up (``give_up_after``
        drafts in a row wholly rejected: drafting does not pay for this text)."""
        p, spec = req.params, self.config
        gave_up = spec.give_up_after is not None and req.spec.misses >= spec.give_up_after
        return (
            not p.penalized and not p.biased and not gave_up and (spec.default if p.speculate is None else p.speculate)
        )

    def reads_mtp_kv(self, req: Request) -> bool:
        """The request's pages need the MTP layer's KV (a model with an MTP module): it drafts with it,
        or it is prefill-only (its decoder may draft from it)."""
        return req.kind is RequestKind.PREFILL_ONLY or (self.mtp and self.may_draft(req))

    def propose(self, req: Request, room: int, running: int) -> list[int]:
        """Draft tokens for ``req`` (the scheduler's ``propose``; ``running``: requests in the batch):
        none for requests that do not speculate; never past ``max_tokens`` or the context."""
        p, spec = req.params, self.config
        if not self.may_draft(req):
            return []
        if spec.max_batch is not None and running > spec.max_batch:
            return []
        if req.spec.skip:  # backing off after drafts that were wholly rejected
            req.spec.skip -= 1
            return []
        room = min(room, spec.num_tokens, p.max_tokens - len(req.output_ids) - 1, self.max_model_len - req.num_tokens)
        if room <= 0:
            return []
        if self._drafter is not None:
            draft = self._drafter.propose(req.all_tokens, room)
        else:  # MTP: the draft the last step's MTP pass made for this very position (one token)
            draft = [req.mtp_draft] if req.mtp_draft is not None and req.mtp_draft_at == req.num_tokens else []
        if req.grammar is not None:  # never verify what the grammar forbids
            draft = draft[: req.grammar.valid_prefix(draft)]
        return draft

    def verify(self, c: ScheduledChunk, logits: torch.Tensor) -> Picked:
        """The tokens a speculative chunk emits (accepted draft tokens + the target's next one)."""
        req, draft, p = c.request, list(c.draft), c.request.params
        if p.greedy:
            target = logits.argmax(dim=-1).tolist()
            n = verify_greedy(target, draft)
            tokens = target[: n + 1]
        else:
            try:
                n, nxt = rejection_sample(probabilities(logits, p), draft, req.sampler.generator)
            except RuntimeError as exc:  # torch's error for a distribution it cannot sample
                return Picked([], [], f"sampling failed: {exc}")
            tokens = [*draft[:n], nxt]
        req.spec.add(len(draft), n)
        req.spec.backoff(n)
        self.stats.add(len(draft), n)
        lps = logprobs_of(logits[: n + 1], tokens, [p.logprobs] * (n + 1)) if p.logprobs is not None else []
        return Picked(tokens, lps)

    def seed(self, req: Request, last_hidden: torch.Tensor | None) -> None:
        """A split request joined with the prefill's last hidden state: draft its first step from it."""
        req.prefill_hidden = last_hidden
        if last_hidden is not None and self.mtp:
            self._seeds.append(req)

    def seed_drafts(self, runner: ModelRunner) -> None:
        """Split requests that just joined with the prefill's last hidden state (position n - 2):
        the MTP module drafts token n from it and prompt token n - 1, so the first step verifies a
        draft. Rewrites the MTP layer's KV at n - 2 (the prefill wrote the same); not a forward pass
        of the layer counter."""
        seeds = [r for r in self._seeds if r.state is RequestState.RUNNING and r.prefill_hidden is not None]
        self._seeds = []
        if not seeds:
            return
        n = [len(r.prompt_ids) for r in seeds]
        spans = [Span([r.prompt_ids[-1]], k - 2, r.pages, 1) for r, k in zip(seeds, n, strict=True)]
        hidden = torch.stack([r.prefill_hidden for r in seeds if r.prefill_hidden is not None])
        inputs = DraftInputs(runner.layout(spans), torch.empty(0, dtype=torch.long), hidden, counted=False)
        drafts = runner.logits(runner.run_draft(inputs)).argmax(dim=-1).tolist()
        for r, k, d in zip(seeds, n, drafts, strict=True):
            r.mtp_draft, r.mtp_draft_at = int(d), k

    def draft_pass(self, sched: SchedulerOutput, picks: dict[int, Picked], runner: ModelRunner, running: int) -> None:
        """The MTP pass (every rank; requests of an engine that drafts with MTP, and prefill-only ones,
        whose decoder may): each position computed in this step whose next token is now known
        (prompt, sampled, accepted) writes its MTP-layer KV; the last position of a request that
        emitted tokens drafts the token after them, for the next step. Positions of rejected drafts
        are left out (their main-layer KV is not counted either)."""
        spans: list[Span] = []
        hidden_rows: list[int] = []
        drafting: list[tuple[Request, int]] = []  # (request, its draft's position)
        limit = self.config.max_batch  # above it nobody drafts next step: no draft logits
        batch_ok = limit is None or running <= limit
        row = 0
        for c in sched.chunks:
            req, picked = c.request, picks.get(id(c))
            speculates = self.mtp and self.may_draft(req)
            if not (speculates or req.kind is RequestKind.PREFILL_ONLY):
                row += c.length  # its MTP KV is never read: no drafts from it here, no decoder to send it to
                req.mtp_kv_gap = True  # its pages lack MTP KV: cached for requests that never read it
                continue
            emitted = picked.tokens if picked is not None else []
            known = req.all_tokens + emitted
            end = min(c.start + (len(emitted) if c.draft else c.length), len(known) - 1)
            if end > c.start:
                # a draft is wanted for the next step, unless the request opted out or backs off then
                wants = bool(emitted) and speculates and batch_ok and not req.spec.skip
                spans.append(Span(known[c.start + 1 : end + 1], c.start, req.pages, int(wants)))
                hidden_rows += range(row, row + end - c.start)
                if wants:
                    drafting.append((req, len(known)))
            row += c.length
        inputs = DraftInputs(runner.layout(spans), torch.tensor(hidden_rows, dtype=torch.long))
        out = runner.run_draft(inputs)
        if drafting:
            drafts = runner.logits(out).argmax(dim=-1).tolist()
            for (req, at), d in zip(drafting, drafts, strict=True):
                req.mtp_draft, req.mtp_draft_at = int(d), at

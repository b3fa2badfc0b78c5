"""What a step emits: the tokens each chunk picks (``pick``: penalties, sampling, speculative
verification, log-probabilities) and their application to the requests (``Outputs.apply``: tokens
appended, stop strings / stop tokens / EOS / length checked, finished requests' pages freed,
``RequestOutput``s built). Neither changes what the other decided.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import ModuleType

import torch

from torch_engine.guided import NO_MASKS, GuideError, MaskPrefetch, MaskWork, PendingMasks, apply_masks
from torch_engine.request import FinishReason, Request, RequestKind, RequestOutput, RequestState
from torch_engine.sampling import (
    InvalidRequestError,
    TokenLogprobs,
    apply_biases,
    apply_penalties,
    logprobs_of,
    sample,
)
from torch_engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from torch_engine.speculator import Picked, Speculator
from torch_engine.tokenizer import IncrementalDetokenizer, Tokenizer

Logits = Callable[[torch.Tensor], torch.Tensor]  # final hidden states -> fp32 logits


def mask_work(sched: SchedulerOutput) -> MaskWork:
    """The grammar masks a step needs (keyed by id(chunk)): chunks that sample or verify drafts for
    a request with a guide."""
    return [(id(c), c.request.grammar, list(c.draft)) for c in sched.chunks
            if c.request.grammar is not None and (c.samples or c.draft)]  # fmt: skip


def pick(
    sched: SchedulerOutput, hidden: torch.Tensor, logits_of: Logits, spec: Speculator, masks: PendingMasks = NO_MASKS,
    eos: frozenset[int] = frozenset(), kernels: ModuleType | None = None,
) -> dict[int, Picked]:  # fmt: skip
    """The tokens each sampling chunk emits (id(chunk) -> picked); changes no request's tokens
    (a prefill-only chunk whose last hidden state is wanted keeps it and its logits). ``masks``:
    the grammar masks of ``mask_work(sched)``, prefetched, applied by ``kernels`` where given."""
    first: dict[int, int] = {}  # id(chunk) -> its first output row in ``hidden`` (``ScheduledChunk.outputs``)
    rows: list[ScheduledChunk] = []  # chunks (no drafts) whose last output row samples or is kept
    n_rows = 0
    for c in sched.chunks:
        if c.outputs:
            first[id(c)], n_rows = n_rows, n_rows + c.outputs
            if not c.draft and (c.samples or (c.completes and c.request.want_last_hidden)):
                rows.append(c)
    last = {k: first[k] + c.outputs - 1 for c in sched.chunks if (k := id(c)) in first}  # its last output row
    logits = logits_of(hidden) if first else hidden
    for c in sched.chunks:
        if c.scores_prompt:
            _score_prompt(c, logits[first[id(c)] : first[id(c)] + c.length])
    picks: dict[int, Picked] = {}
    for c in sched.chunks:
        if c.draft:
            mine = logits[first[id(c)] : first[id(c)] + c.length]
            if c.request.grammar is not None:
                mine = mine.clone()  # the step's logits are an inference tensor: mask a copy
            error = _constrain(mine, list(range(c.length)), c, masks, kernels)
            picks[id(c)] = error or spec.verify(c, mine)
    sampled = [c for c in rows if c.samples]
    reqs = [c.request for c in sampled]
    params = [r.params for r in reqs]
    at = [last[id(c)] for c in sampled]
    penalized, biased = any(p.penalized for p in params), any(p.biased for p in params)
    changed = penalized or biased or any(r.grammar is not None for r in reqs)
    # a decode-only step samples its rows in order: a view of them where nothing below changes them in place
    # (the gather copied 1.5 MB at batch 8, 0.1 ms), else a copy (the step's logits are an inference tensor)
    chosen = (logits[: len(at)] if not changed and at == list(range(len(at))) else logits[at]).float()
    if penalized:
        apply_penalties(chosen, params, [(r.prompt_ids, r.output_ids) for r in reqs])
    if biased:  # logit_bias; EOS (``eos``) and stop ids held back until min_tokens
        apply_biases(chosen, params, [len(r.output_ids) for r in reqs], eos)
    failed: dict[int, str] = {}
    for j, c in enumerate(sampled):  # the grammar's mask last: no penalty can bring a masked token back
        if c.request.grammar is not None and (error := _constrain(chosen, [j], c, masks, kernels)) is not None:
            failed[j] = error.error or ""
    tokens = sample(chosen, params, [r.sampler for r in reqs], failed, kernels)
    wanted = [j for j, p in enumerate(params) if p.logprobs is not None and j not in failed]
    logprobs: dict[int, TokenLogprobs] = {}
    if wanted:
        found = logprobs_of(chosen[wanted], [tokens[j] for j in wanted], [params[j].logprobs or 0 for j in wanted])
        logprobs = {j: lp for j, lp in zip(wanted, found, strict=True)}
    for j, c in enumerate(sampled):
        lp = logprobs.get(j)
        picks[id(c)] = Picked([], [], failed[j]) if j in failed else Picked([tokens[j]], [lp] if lp is not None else [])
    for c in rows:
        if c.request.want_last_hidden:
            i = last[id(c)]
            c.request.last_hidden, c.request.last_logits = hidden[i].cpu(), logits[i].cpu()
    return picks


def _score_prompt(c: ScheduledChunk, logits: torch.Tensor) -> None:
    """Record the log-probabilities of the prompt tokens that the chunk's rows predict (row i, at
    position start + i, predicts prompt token start + i + 1); positions already scored (a preempted
    request computing its prompt again) are skipped."""
    req = c.request
    if not req.prompt_lps:
        req.prompt_lps.append(None)  # nothing predicts the first token
    at = len(req.prompt_lps)  # the next prompt token to score
    lo, hi = at - 1 - c.start, min(c.length, len(req.prompt_ids) - 1 - c.start)
    if lo < 0 or lo >= hi:
        return
    k = req.params.prompt_logprobs or 0
    req.prompt_lps += logprobs_of(logits[lo:hi], req.prompt_ids[at : at + hi - lo], [k] * (hi - lo))


def _constrain(
    logits: torch.Tensor, rows: list[int], c: ScheduledChunk, masks: PendingMasks, kernels: ModuleType | None
) -> Picked | None:
    """Mask ``logits`` rows (a chunk's next position, then one per draft token) to what the chunk's
    grammar allows; a grammar in an error state fails that request alone (the returned ``Picked``)."""
    if c.request.grammar is None:
        return None
    try:
        apply_masks(logits, rows, masks.get(id(c), c.request.grammar, list(c.draft)), kernels)
    except GuideError as exc:
        return Picked([], [], str(exc))
    return None


class Outputs:
    """Applies a step's picks; owns the stop-string detokenisers of live requests and the worker that
    computes a step's grammar masks beside its forward pass (``prefetch``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        eos_ids: Collection[int],
        max_model_len: int,
        kernels: ModuleType | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._kernels = kernels  # the CPU kernels: grammar masks applied in one C++ pass
        self._tokenizer = tokenizer
        self._eos_ids = frozenset(eos_ids)
        # a request ends with "length" at the model's context, or at the whole pool's if smaller: one that
        # outgrew the pool alone would be preempted by itself and recomputed without end
        self._max_model_len = min(max_model_len, scheduler.allocator.num_pages * scheduler.page_size)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._masks = MaskPrefetch()

    def pick(
        self, sched: SchedulerOutput, hidden: torch.Tensor, logits_of: Logits, spec: Speculator, masks: PendingMasks
    ) -> dict[int, Picked]:
        """``pick`` with this engine's EOS ids (what ``min_tokens`` holds back)."""
        return pick(sched, hidden, logits_of, spec, masks, self._eos_ids, self._kernels)

    def prefetch(self, sched: SchedulerOutput) -> PendingMasks:
        """Start the step's grammar masks (``pick`` waits for them); call before the forward pass."""
        return self._masks.start(mask_work(sched))

    def watch(self, req: Request) -> None:
        """A new request with stop strings gets a detokeniser (InvalidRequestError without a tokenizer)."""
        if not req.params.stop:
            return
        if self._tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
        self._detok[req.request_id] = IncrementalDetokenizer(self._tokenizer, req.prompt_ids[-4:])

    def finish(self, req: Request, state: RequestState, reason: FinishReason, error: str | None = None) -> None:
        self._scheduler.finish(req, state, reason, error)
        self._detok.pop(req.request_id, None)

    def apply(self, sched: SchedulerOutput, picks: dict[int, Picked]) -> list[RequestOutput]:
        outputs = []
        for c in sched.chunks:
            req = c.request
            failed = picks.get(id(c))
            if failed is not None and failed.error is not None:  # this request alone fails
                self.finish(req, RequestState.FAILED, FinishReason.ERROR, failed.error)
                outputs.append(self._failure(req, failed.error))
                continue
            if c.draft:
                p = picks[id(c)]
                req.num_computed += len(p.tokens)  # its next token and the accepted drafts now have KV
                self._scheduler.computed(req)
                outputs.append(self._append_tokens(req, p.tokens, p.logprobs))
                self._scheduler.trim(req)  # pages past the rejected positions go back
                continue
            req.num_computed += c.length
            self._scheduler.computed(req)
            if req.kind is RequestKind.PREFILL_ONLY and c.completes:
                self._scheduler.mark_prefilled(req)
                outputs.append(
                    RequestOutput(
                        request_id=req.request_id,
                        finished=True,
                        finish_reason=FinishReason.PREFILLED,
                        prompt_tokens=len(req.prompt_ids),
                        cached_tokens=req.cached_tokens or 0,
                    )
                )
            elif c.samples:
                p = picks[id(c)]
                outputs.append(self._append_token(req, p.tokens[0], p.logprobs[0] if p.logprobs else None))
        return outputs

    def _append_tokens(self, req: Request, tokens: list[int], lps: list[TokenLogprobs]) -> RequestOutput:
        """Several tokens of one step (speculation), one by one through the stop checks; one output."""
        outs: list[RequestOutput] = []
        for j, t in enumerate(tokens):
            outs.append(self._append_token(req, t, lps[j] if lps else None))
            if outs[-1].finished:
                break
        last = outs[-1]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[t for o in outs for t in o.new_token_ids],
            output_ids=list(req.output_ids),
            finished=last.finished,
            finish_reason=last.finish_reason,
            text="".join(o.text for o in outs),
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens or 0,
            logprobs=tuple(lp for o in outs for lp in o.logprobs),
            prompt_logprobs=outs[0].prompt_logprobs,
            drafts=(req.spec.proposed, req.spec.accepted),
        )

    def _failure(self, req: Request, error: str) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, finished=True, finish_reason=FinishReason.ERROR, error=error,
            output_ids=list(req.output_ids), prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens or 0,
        )  # fmt: skip

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        req.output_ids.append(token)
        p = req.params
        reason: FinishReason | None = None
        if req.grammar is not None:
            if not req.grammar.accept(token):  # the mask allowed it: the guide needs bytes no token holds
                error = (
                    f"the guide cannot be followed with this model's tokens: token {token}, allowed by the "
                    f"guide's mask, was refused by its parser ({req.grammar.error})"
                )
                self.finish(req, RequestState.FAILED, FinishReason.ERROR, error)
                return self._failure(req, error)
            if req.grammar.done:
                reason = FinishReason.STOP
        delta = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            try:
                delta = detok.push([token])
            except Exception as exc:  # the tokenizer's own error types: this request fails, not the step
                self.finish(req, RequestState.FAILED, FinishReason.ERROR, f"detokenising failed: {exc}")
                return self._failure(req, f"detokenising failed: {exc}")
            # a stop string can newly appear only where it overlaps the new text: search that tail
            text = detok.text
            tail = text[-(len(delta) + max(map(len, p.stop))) :] if delta else ""
            hit = next((s for s in p.stop if s in tail), None)
            if hit is not None:
                req.text = text[: len(text) - len(tail) + tail.index(hit)]
                reason = FinishReason.STOP
            else:
                req.text = text
        if reason is None and ((token in self._eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            reason = FinishReason.STOP
        elif reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens >= self._max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self.finish(req, RequestState.FINISHED, reason)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            output_ids=list(req.output_ids),
            finished=reason is not None,
            finish_reason=reason,
            text=delta,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens or 0,
            logprobs=(logprobs,) if logprobs is not None else (),
            prompt_logprobs=tuple(req.prompt_lps) if len(req.output_ids) == 1 else (),
            drafts=(req.spec.proposed, req.spec.accepted),
        )

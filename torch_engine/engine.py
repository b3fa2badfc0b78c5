"""The engine: requests in, tokens out, one ``step()`` at a time.

``LLMEngine`` owns the model (this rank's shard), the paged KV cache, the page allocator,
the scheduler and the per-layer progress counter. It never imports Triton or the messenger;
a messenger plugs in through ``StepObserver`` (told what runs before each step), the page
allocator, ``LayerProgress``, and the split-request calls (``add_request(kind=...)``,
``reserve_for_kv`` / ``kv_ready`` / ``kv_failed``, ``release``).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors.torch import load_file

from torch_engine.config import EngineConfig, EngineManifest
from torch_engine.kv_cache import PageAllocator, PagedKVCache, PageStats
from torch_engine.layer_progress import LayerProgress
from torch_engine.model_runner import ModelRunner
from torch_engine.models import build_model, cache_spec
from torch_engine.models.decoder import CausalLM
from torch_engine.parallel import TPGroup
from torch_engine.request import FinishReason, Request, RequestKind, RequestOutput, RequestState
from torch_engine.sampling import InvalidRequestError, SamplerState, SamplingParams, sample
from torch_engine.scheduler import Scheduler, SchedulerOutput
from torch_engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StepObserver(Protocol):
    def before_step(self, sched: SchedulerOutput) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a finished prefill-only request leaves behind (its pages stay held until ``release``)."""

    request_id: str
    pages: list[int]
    num_tokens: int  # tokens of KV in the pages: the prompt minus its last token
    last_hidden: torch.Tensor | None
    last_logits: torch.Tensor | None


def load_weights(manifest: EngineManifest, config: EngineConfig, tp: TPGroup, device: torch.device) -> CausalLM:
    path = config.engine_dir / f"rank{tp.rank}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{config.engine_dir} has no weights for TP rank {tp.rank} ({path.name})")
    try:
        state = load_file(str(path), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path} is corrupt or unreadable: {exc}") from exc
    dtype = (config.dtype or manifest.dtype).torch
    with torch.device("meta"):
        model = build_model(manifest.model, tp)
    expected = set(model.state_dict())
    if manifest.model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    keep_fp32 = ("router.weight", "router_bias")
    state = {k: v if k.endswith(keep_fp32) else v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if manifest.model.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, load_tokenizer: bool = True) -> None:
        self.config = config
        self.manifest = EngineManifest.load(config.engine_dir)
        self.tp = tp or TPGroup.single()
        if self.tp.size != self.manifest.tp_size:
            raise ValueError(f"engine {config.engine_dir} was built for TP {self.manifest.tp_size}, not {self.tp.size}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = self.manifest.model
        self.device = torch.device(config.device)
        self.dtype = (config.dtype or self.manifest.dtype).torch
        self.page_size = config.page_size or self.manifest.page_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.model = load_weights(self.manifest, config, self.tp, self.device)
        layout = config.kv_layout or self.manifest.kv_layout
        self.kv = PagedKVCache(
            cache_spec(mc, self.tp.size, config.num_pages, self.page_size, layout, self.dtype), self.device
        )
        self.progress = LayerProgress(mc.num_layers, self.device)
        self.allocator = PageAllocator(config.num_pages)
        self.scheduler = Scheduler(
            self.allocator, self.page_size, config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_chunk
        )
        self.runner = ModelRunner(self.model, self.kv, self.progress, self.tp, self.device, self.max_model_len)
        self.tokenizer = Tokenizer(config.engine_dir) if load_tokenizer and self.manifest.has_tokenizer else None
        self.eos_ids = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.requests: dict[str, Request] = {}
        self.observers: list[StepObserver] = []
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._seed_rng = random.Random(0)

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kind: RequestKind = RequestKind.GENERATE,
        want_last_hidden: bool = False,
        chat: bool = False,
    ) -> str:
        """Validate and queue a request; raises ``InvalidRequestError`` naming the problem."""
        req = self._new_request(prompt, params, request_id, kind, chat)
        req.want_last_hidden = want_last_hidden
        self.requests[req.request_id] = req
        if kind is RequestKind.PREFILL_ONLY and req.compute_target == 0:
            req.state = RequestState.PREFILLED  # a one-token prompt has no KV to prefill
            self.scheduler.prefilled[req.request_id] = req
        else:
            self.scheduler.add(req)
        return req.request_id

    def reserve_for_kv(
        self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> tuple[str, list[int]]:
        """Decode half of a split request: reserve and pin pages for the KV of ``prompt[:-1]``."""
        req = self._new_request(prompt, params, request_id, RequestKind.DECODE_FROM_KV, False)
        n = len(req.prompt_ids) - 1
        if not self.scheduler.can_reserve(n):
            raise InvalidRequestError(f"not enough free KV pages for {n} tokens right now; retry later")
        self.requests[req.request_id] = req
        self.scheduler.reserve(req, n)
        return req.request_id, list(req.pages)

    def kv_ready(self, request_id: str) -> None:
        """All KV of a reserved request has landed: it joins the batch and runs its last prompt token."""
        req = self._get(request_id)
        if req.state is not RequestState.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV (state {req.state.name})")
        self.scheduler.kv_ready(req)

    def kv_failed(self, request_id: str, error: str) -> None:
        self._finish(self._get(request_id), RequestState.FAILED, FinishReason.ERROR, error)

    def prefill_result(self, request_id: str) -> PrefillResult:
        req = self._get(request_id)
        if req.state is not RequestState.PREFILLED:
            raise ValueError(f"request {request_id} is not prefilled (state {req.state.name})")
        return PrefillResult(req.request_id, list(req.pages), req.num_computed, req.last_hidden, req.last_logits)

    def release(self, request_id: str) -> None:
        """Free the pages of a prefilled request (its KV has been sent)."""
        req = self._get(request_id)
        if req.state is not RequestState.PREFILLED:
            raise ValueError(f"request {request_id} is not prefilled (state {req.state.name})")
        self._finish(req, RequestState.FINISHED, FinishReason.PREFILLED)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; returns False if it is unknown or already over."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, RequestState.ABORTED, FinishReason.ABORT)
        return True

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return []
        for obs in self.observers:
            obs.before_step(sched)
        hidden = self.runner.run(sched)
        return self._postprocess(sched, hidden)

    def has_unfinished(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running)

    def page_stats(self) -> PageStats:
        return self.allocator.stats()

    def shutdown(self) -> None:
        """Leader: release the TP followers from ``run_follower``."""
        self.runner.stop_followers()

    def run_follower(self, on_message: Callable[[object], None] | None = None) -> None:
        """TP ranks > 0: execute every step the leader broadcasts until it shuts down (``on_message``
        handles what a ``TickHook`` on the leader wraps the steps in)."""
        if self.tp.is_leader:
            raise RuntimeError("the TP leader drives the engine with step(); only followers run this loop")
        self.runner.follower_loop(on_message)

    # -- conveniences --------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        out = [list(self.requests[i].output_ids) for i in ids]
        for i in ids:
            self.requests.pop(i, None)
        return out

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[RequestOutput]:
        rid = self.add_request(prompt, params, chat=chat)
        try:
            while not self.requests[rid].finished:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
        finally:
            self.abort(rid)
            self.requests.pop(rid, None)

    # -- internals -----------------------------------------------------------------------
    def _new_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        kind: RequestKind,
        chat: bool,
    ) -> Request:
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt, chat=chat)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.manifest.model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} (prompt + output)"
            )
        need = self.scheduler.pages_for(len(ids) + 1)
        if need > self.allocator.num_pages:
            raise InvalidRequestError(f"prompt needs {need} KV pages; the pool has {self.allocator.num_pages}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, ids, params, kind, SamplerState.seeded(seed))
        if params.stop and self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, ids[-4:])
        elif params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
        return req

    def _get(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _finish(self, req: Request, state: RequestState, reason: FinishReason, error: str | None = None) -> None:
        self.scheduler.finish(req, state, reason, error)
        self._detok.pop(req.request_id, None)

    def _postprocess(self, sched: SchedulerOutput, hidden: torch.Tensor) -> list[RequestOutput]:
        rows = [c for c in sched.chunks if c.samples or (c.completes and c.request.want_last_hidden)]
        logits = self.runner.logits(hidden) if rows else hidden
        sampling = [i for i, c in enumerate(rows) if c.samples]
        tokens = sample(
            logits[sampling], [rows[i].request.params for i in sampling], [rows[i].request.sampler for i in sampling]
        )
        by_req = {id(rows[i].request): t for i, t in zip(sampling, tokens, strict=True)}
        for i, c in enumerate(rows):
            if c.request.want_last_hidden:
                c.request.last_hidden, c.request.last_logits = hidden[i].cpu(), logits[i].cpu()
        outputs = []
        for c in sched.chunks:
            req = c.request
            req.num_computed += c.length
            if req.kind is RequestKind.PREFILL_ONLY and c.completes:
                self.scheduler.mark_prefilled(req)
                outputs.append(RequestOutput(req.request_id, [], [], True, FinishReason.PREFILLED))
            elif c.samples:
                outputs.append(self._append_token(req, by_req[id(req)]))
        return outputs

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        req.output_ids.append(token)
        p = req.params
        reason: FinishReason | None = None
        delta = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            delta = detok.push([token])
            hit = next((s for s in p.stop if s in detok.text), None)
            if hit is not None:
                req.text = detok.text[: detok.text.index(hit)]
                reason = FinishReason.STOP
            else:
                req.text = detok.text
        if reason is None and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            reason = FinishReason.STOP
        elif reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(req, RequestState.FINISHED, reason)
        return RequestOutput(
            req.request_id, [token], list(req.output_ids), reason is not None, reason, None, delta, len(req.prompt_ids)
        )

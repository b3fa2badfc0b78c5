"""The engine: requests in, tokens out, one ``step()`` at a time.

``LLMEngine`` owns the model (this rank's shard), the paged KV cache, the page allocator,
the scheduler and the per-layer progress counter; all of them are private. It never imports
Triton, the messenger or the serving runtime: a KV connector drives it through the port that
``torch_engine/connector.py`` documents (admit, before step, around the step, poll), using only
the public methods below.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from torch_engine.config import EngineConfig, EngineManifest, SpecMethod
from torch_engine.connector import StepObserver, TickHook
from torch_engine.cpu import cpu_info
from torch_engine.decode_graphs import DecodeGraphs
from torch_engine.kernels import cpu_kernels
from torch_engine.kv_cache import PageAllocator, PagedKVCache, PageStats
from torch_engine.layer_progress import LayerProgress
from torch_engine.layers import Linear, RMSNorm
from torch_engine.model_runner import DraftInputs, ModelRunner, Span, StepInputs
from torch_engine.models import build_model, cache_spec
from torch_engine.models.decoder import CausalLM
from torch_engine.parallel import TPGroup
from torch_engine.request import FinishReason, Request, RequestKind, RequestOutput, RequestState
from torch_engine.sampling import (
    InvalidRequestError,
    SamplerState,
    SamplingParams,
    TokenLogprobs,
    apply_penalties,
    logprobs_of,
    probabilities,
    sample,
)
from torch_engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from torch_engine.speculative import NgramDrafter, SpecStats, rejection_sample, verify_greedy
from torch_engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a finished prefill-only request leaves behind (its pages stay held until ``release``)."""

    request_id: str
    pages: list[int]
    num_tokens: int  # tokens of KV in the pages: the prompt minus its last token
    last_hidden: torch.Tensor | None
    last_logits: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    decoding: int  # running requests past their first token
    mean_context: float  # their mean context (tokens)
    prefill_tokens: int  # prompt tokens still to compute, waiting and running requests
    chunk: int  # tokens per step (the scheduler's budget)


@dataclass(slots=True)
class _Picked:
    """What a sampling chunk emits this step: tokens (its next one, after any accepted drafts)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]


def run_dtype(config: EngineConfig, manifest: EngineManifest, device: torch.device) -> torch.dtype:
    """The dtype the engine computes in: the config's, or ``auto``: bf16 on GPUs and on CPUs with native
    bf16 dot products (AVX-512 BF16 / AMX), fp32 elsewhere; None: the manifest's."""
    if config.dtype == "auto":
        native = device.type == "cuda" or cpu_info().native_bf16
        return torch.bfloat16 if native else torch.float32
    return (config.dtype or manifest.dtype).torch


def load_weights(
    manifest: EngineManifest, config: EngineConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype
) -> CausalLM:
    path = config.engine_dir / f"rank{tp.rank}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{config.engine_dir} has no weights for TP rank {tp.rank} ({path.name})")
    try:
        state = load_file(str(path), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path} is corrupt or unreadable: {exc}") from exc
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
        self.dtype = run_dtype(config, self.manifest, self.device)
        self.page_size = config.page_size or self.manifest.page_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.model = load_weights(self.manifest, config, self.tp, self.device, self.dtype)
        fast = (config.fast_cpu or config.dtype == "auto") and self.device.type == "cpu"
        self.prepacked = fast and self._prepare_cpu_path()
        layout = config.kv_layout or self.manifest.kv_layout
        graphs = config.decode_graphs if config.decode_graphs is not None else self.device.type == "cuda"
        graphs = graphs and self.tp.size == 1 and not mc.n_routed_experts
        pool_pages = config.num_pages + int(graphs)  # + the decode graphs' scratch page, outside the allocator
        spec = cache_spec(mc, self.tp.size, pool_pages, self.page_size, layout, self.dtype)
        self.kv = PagedKVCache(spec, self.device)
        self.kv.kernels = cpu_kernels() if fast else None
        self.progress = LayerProgress(mc.num_kv_layers, self.device)
        self._allocator = PageAllocator(config.num_pages)
        self._scheduler = Scheduler(
            self._allocator,
            self.page_size,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_prefill_chunk,
        )
        self._runner = ModelRunner(self.model, self.kv, self.progress, self.tp, self.device, self.max_model_len)
        if graphs:
            self._runner.use_decode_graphs(config.num_pages, config.scheduler.max_num_seqs)
        self.tokenizer = Tokenizer(config.engine_dir) if load_tokenizer and self.manifest.has_tokenizer else None
        self.eos_ids = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self._requests: dict[str, Request] = {}
        self._observers: list[StepObserver] = []
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._seed_rng = random.Random(0)
        drafting = config.speculative
        ngram = drafting.method is SpecMethod.NGRAM
        self._drafter = NgramDrafter(drafting.ngram_max, drafting.ngram_min) if ngram else None
        if drafting.method is SpecMethod.MTP and self.model.mtp is None:
            raise ValueError(
                f"speculative method mtp needs a checkpoint with an MTP module (num_nextn_predict_layers); "
                f"the engine in {config.engine_dir} has none"
            )
        self._mtp_drafts = drafting.method is SpecMethod.MTP
        self._seeds: list[Request] = []  # split requests whose first draft comes from the prefill's hidden state
        self.spec_stats = SpecStats()  # draft tokens proposed / accepted by this engine
        if self._drafter is not None or self._mtp_drafts:
            self._scheduler.propose = self._propose

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
        self._requests[req.request_id] = req
        if kind is RequestKind.PREFILL_ONLY and req.compute_target == 0:
            req.state = RequestState.PREFILLED  # a one-token prompt has no KV to prefill
            self._scheduler.prefilled[req.request_id] = req
        else:
            self._scheduler.add(req)
        return req.request_id

    def reserve_for_kv(
        self, prompt: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> tuple[str, list[int]]:
        """Decode half of a split request: reserve and pin pages for the KV of ``prompt[:-1]``."""
        req = self._new_request(prompt, params, request_id, RequestKind.DECODE_FROM_KV, False)
        n = len(req.prompt_ids) - 1
        if not self._scheduler.can_reserve(n):
            raise InvalidRequestError(f"not enough free KV pages for {n} tokens right now; retry later")
        self._requests[req.request_id] = req
        self._scheduler.reserve(req, n)
        return req.request_id, list(req.pages)

    def replace_kv_pages(self, request_id: str) -> list[int]:
        """A reserved request's KV will come from another sender into fresh pages: allocate and pin
        new pages (``InvalidRequestError`` when the pool has too few free), free the old ones (the
        free waits for the caller's pins: a write may still land there). Returns the new pages."""
        req = self._get(request_id)
        if req.state is not RequestState.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV (state {req.state.name})")
        if not self._scheduler.can_reserve(len(req.prompt_ids) - 1):
            raise InvalidRequestError(f"not enough free KV pages to move request {request_id} to fresh pages")
        self._scheduler.replace_reserved(req)
        return list(req.pages)

    def kv_ready(self, request_id: str, last_hidden: torch.Tensor | None = None) -> None:
        """All KV of a reserved request has landed: it joins the batch and runs its last prompt token.
        ``last_hidden``: the prefill's final hidden state at its last position (``prompt[-2]``); an
        engine that drafts with MTP drafts from it before the first step, which then verifies a
        draft (``wants_prefill_hidden``)."""
        req = self._get(request_id)
        if req.state is not RequestState.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV (state {req.state.name})")
        size = self.manifest.model.hidden_size
        if last_hidden is not None and tuple(last_hidden.shape) != (size,):
            raise ValueError(
                f"request {request_id}: a last hidden state of shape {tuple(last_hidden.shape)}, not ({size},)"
            )
        self._scheduler.kv_ready(req)
        req.prefill_hidden = last_hidden
        if last_hidden is not None and self._mtp_drafts:
            self._seeds.append(req)

    @property
    def wants_prefill_hidden(self) -> bool:
        """This engine drafts with MTP: a split request's first step can verify a draft made from
        the prefill's last hidden state (ask the prefill node for it)."""
        return self._mtp_drafts

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
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, RequestState.ABORTED, FinishReason.ABORT)
        return True

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._seeds:
            self._seed_drafts()
        sched = self._scheduler.schedule()
        if not sched.chunks:
            return []
        for obs in self._observers:
            obs.before_step(sched)
        hidden = self._runner.run(sched)
        picks = self._choose(sched, hidden)
        if self.model.mtp is not None:
            self._draft_pass(sched, picks)
        for obs in self._observers:
            obs.after_forward(sched)
        return self._apply(sched, picks)

    def has_unfinished(self) -> bool:
        s = self._scheduler
        return bool(s.waiting or s.running)

    def page_stats(self) -> PageStats:
        return self._allocator.stats()

    @property
    def kernel_path(self) -> str:
        """Which compute path this engine runs: device, dtype, weight preparation, decode graphs."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.device.type == "cuda":
            graphs = "cuda-graphs" if self._runner.graphs is not None else "eager"
            return f"cuda/{dtype}/{graphs}"
        small = any(m.kernels is not None for m in self.model.modules() if isinstance(m, Linear))
        gemm = ("gemm-bf16+onednn-packed" if small else "onednn-packed") if self.prepacked else "plain"
        attention = "fused-attention" if self.kv.kernels is not None else "torch-attention"
        return f"cpu/{dtype}/{gemm}/{attention}/{cpu_info().simd}"

    def decode_graphs_stats(self) -> DecodeGraphs | None:
        """The decode-graph buckets (``replays``, ``captured``), or None when this engine runs eagerly."""
        return self._runner.graphs

    def _prepare_cpu_path(self) -> bool:
        """The fast CPU path (CPU, fp32 / bf16): every GEMM weight prepared once (oneDNN packing, and the
        small-batch bf16 kernel's copy where the CPU has it), RMSNorm on the compiled kernel. True if
        any weight was packed."""
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            return False
        kernels = cpu_kernels()
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        for m in linears:
            m.prepare(kernels)
        for norm in (m for m in self.model.modules() if isinstance(m, RMSNorm)):
            norm.kernels = kernels
        return any(m.packed is not None for m in linears)

    def queue_depths(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        return len(self._scheduler.waiting), len(self._scheduler.running)

    def load(self) -> EngineLoad:
        """What the engine has on its hands now (a decode node's placement rule reads it)."""
        s = self._scheduler
        prefilling = [r for r in (*s.waiting, *s.running) if not r.output_ids]
        pending = sum(r.compute_target - r.num_computed for r in prefilling)
        decoding = [r for r in s.running if r.output_ids]
        context = sum(r.num_tokens for r in decoding) / len(decoding) if decoding else 0.0
        return EngineLoad(len(decoding), context, pending, self.config.scheduler.max_num_batched_tokens)

    # -- the connector port (torch_engine/connector.py) ----------------------------------
    def attach(self, observer: StepObserver) -> None:
        """Call ``observer`` before every step and after its forward pass."""
        self._observers.append(observer)

    def set_tick_hook(self, hook: TickHook | None) -> None:
        """TP leader: wrap each step's broadcast (the messenger's commands ride along)."""
        self._runner.tick_hook = hook

    def next_forward(self) -> int:
        """The layer counter value the next forward pass reaches (``progress.completed(layer)`` of
        every layer equals it once that pass has run)."""
        return self.progress.completed(self.progress.num_layers - 1) + 1

    def pin_pages(self, pages: list[int]) -> None:
        """Hold pages against reuse (a transfer reads or writes them); the scheduler never preempts a
        request with pinned pages, and freeing a pinned page waits for its last ``unpin_pages``."""
        self._allocator.pin(pages)

    def unpin_pages(self, pages: list[int]) -> None:
        self._allocator.unpin(pages)

    def can_reserve(self, num_tokens: int) -> bool:
        return self._scheduler.can_reserve(num_tokens)

    def request(self, request_id: str) -> Request:
        """The record of a known request (finished ones stay until ``retire``); KeyError if unknown."""
        return self._get(request_id)

    def num_requests(self) -> int:
        """Requests the engine keeps a record of (live, or finished and not yet retired)."""
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def retire(self, request_id: str) -> Request | None:
        """Forget a finished request (aborting it first if it is still live); returns its record."""
        self.abort(request_id)
        return self._requests.pop(request_id, None)

    def waiting_for_kv(self) -> list[str]:
        return list(self._scheduler.kv_wait)

    def prefilled(self) -> list[str]:
        return list(self._scheduler.prefilled)

    @property
    def num_preemptions(self) -> int:
        return self._scheduler.num_preemptions

    def execute_step(self, inputs: StepInputs) -> None:
        """TP follower: run one broadcast step (the leader's ``TickHook`` wrapped it)."""
        self._runner.execute(inputs)

    def shutdown(self) -> None:
        """Leader: release the TP followers from ``run_follower``."""
        self._runner.stop_followers()

    def run_follower(self, on_message: Callable[[object], None] | None = None) -> None:
        """TP ranks > 0: execute every step the leader broadcasts until it shuts down (``on_message``
        handles what a ``TickHook`` on the leader wraps the steps in)."""
        if self.tp.is_leader:
            raise RuntimeError("the TP leader drives the engine with step(); only followers run this loop")
        self._runner.follower_loop(on_message)

    # -- conveniences --------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [list(r.output_ids) for r in (self.retire(i) for i in ids) if r is not None]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[RequestOutput]:
        rid = self.add_request(prompt, params, chat=chat)
        try:
            while not self._requests[rid].finished:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
        finally:
            self.retire(rid)

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
        self.check_prompt(ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(request_id=rid, prompt_ids=ids, params=params, kind=kind, sampler=SamplerState.seeded(seed))
        if params.stop and self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, ids[-4:])
        elif params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
        return req

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Raise ``InvalidRequestError`` naming the problem if this engine cannot take the prompt."""
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
        need = self._scheduler.pages_for(len(ids) + 1)
        if need > self._allocator.num_pages:
            raise InvalidRequestError(f"prompt needs {need} KV pages; the pool has {self._allocator.num_pages}")

    def _get(self, request_id: str) -> Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _finish(self, req: Request, state: RequestState, reason: FinishReason, error: str | None = None) -> None:
        self._scheduler.finish(req, state, reason, error)
        self._detok.pop(req.request_id, None)

    def _may_draft(self, req: Request) -> bool:
        """The request speculates: it opted in (or left it to the default), has no penalties (its
        logits would depend on the tokens a draft adds), and has not given up (``give_up_after``
        drafts in a row wholly rejected: drafting does not pay for this text)."""
        p, spec = req.params, self.config.speculative
        gave_up = spec.give_up_after is not None and req.spec.misses >= spec.give_up_after
        return not p.penalized and not gave_up and (spec.default if p.speculate is None else p.speculate)

    def _propose(self, req: Request, room: int) -> list[int]:
        """Draft tokens for ``req`` (the scheduler's ``propose``): none for requests that do not
        speculate (``_may_draft``); never past ``max_tokens`` or the context."""
        p, spec = req.params, self.config.speculative
        if not self._may_draft(req):
            return []
        if spec.max_batch is not None and len(self._scheduler.running) > spec.max_batch:
            return []
        if req.spec.skip:  # backing off after drafts that were wholly rejected
            req.spec.skip -= 1
            return []
        room = min(room, spec.num_tokens, p.max_tokens - len(req.output_ids) - 1, self.max_model_len - req.num_tokens)
        if room <= 0:
            return []
        if self._drafter is not None:
            return self._drafter.propose(req.all_tokens, room)
        # MTP: the draft the last step's MTP pass made for this very position (one token)
        return [req.mtp_draft] if req.mtp_draft is not None and req.mtp_draft_at == req.num_tokens else []

    def _verify(self, c: ScheduledChunk, logits: torch.Tensor) -> _Picked:
        """The tokens a speculative chunk emits (accepted draft tokens + the target's next one)."""
        req, draft, p = c.request, list(c.draft), c.request.params
        if p.greedy:
            target = logits.argmax(dim=-1).tolist()
            n = verify_greedy(target, draft)
            tokens = target[: n + 1]
        else:
            n, nxt = rejection_sample(probabilities(logits, p), draft, req.sampler.generator)
            tokens = [*draft[:n], nxt]
        req.spec.add(len(draft), n)
        req.spec.backoff(n)
        self.spec_stats.add(len(draft), n)
        lps = logprobs_of(logits[: n + 1], tokens, [p.logprobs] * (n + 1)) if p.logprobs is not None else []
        return _Picked(tokens, lps)

    def _choose(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[int, _Picked]:
        """The tokens each sampling chunk emits (id(chunk) -> picked); changes no request's tokens."""
        first: dict[int, int] = {}  # id(chunk) -> its first row in ``hidden``
        rows: list[ScheduledChunk] = []  # chunks with exactly one row
        n_rows = 0
        for c in sched.chunks:
            if c.draft:
                first[id(c)], n_rows = n_rows, n_rows + c.length
            elif c.samples or (c.completes and c.request.want_last_hidden):
                first[id(c)], n_rows = n_rows, n_rows + 1
                rows.append(c)
        logits = self._runner.logits(hidden) if first else hidden
        picks = {
            id(c): self._verify(c, logits[first[id(c)] : first[id(c)] + c.length]) for c in sched.chunks if c.draft
        }
        sampling = [first[id(c)] for c in rows if c.samples]
        reqs = [c.request for c in rows if c.samples]
        params = [r.params for r in reqs]
        chosen = logits[sampling].float()
        if any(p.penalized for p in params):
            apply_penalties(chosen, params, [(r.prompt_ids, r.output_ids) for r in reqs])
        tokens = sample(chosen, params, [r.sampler for r in reqs])
        wanted = [j for j, p in enumerate(params) if p.logprobs is not None]
        logprobs: dict[int, TokenLogprobs] = {}
        if wanted:
            found = logprobs_of(chosen[wanted], [tokens[j] for j in wanted], [params[j].logprobs or 0 for j in wanted])
            logprobs = {j: lp for j, lp in zip(wanted, found, strict=True)}
        sampled = [c for c in rows if c.samples]
        for j, c in enumerate(sampled):
            lp = logprobs.get(j)
            picks[id(c)] = _Picked([tokens[j]], [lp] if lp is not None else [])
        for c in rows:
            if c.request.want_last_hidden:
                i = first[id(c)]
                c.request.last_hidden, c.request.last_logits = hidden[i].cpu(), logits[i].cpu()
        return picks

    def _draft_pass(self, sched: SchedulerOutput, picks: dict[int, _Picked]) -> None:
        """The MTP pass (every rank; requests of an engine that drafts with MTP, and prefill-only ones,
        whose decoder may): each position computed in this step whose next token is now known
        (prompt, sampled, accepted) writes its MTP-layer KV; the last position of a request that
        emitted tokens drafts the token after them, for the next step. Positions of rejected drafts
        are left out (their main-layer KV is not counted either)."""
        spans: list[Span] = []
        hidden_rows: list[int] = []
        drafting: list[tuple[Request, int]] = []  # (request, its draft's position)
        limit = self.config.speculative.max_batch  # above it nobody drafts next step: no draft logits
        batch_ok = limit is None or len(self._scheduler.running) <= limit
        row = 0
        for c in sched.chunks:
            req, picked = c.request, picks.get(id(c))
            speculates = self._mtp_drafts and self._may_draft(req)
            if not (speculates or req.kind is RequestKind.PREFILL_ONLY):
                row += c.length  # its MTP KV is never read: no drafts from it here, no decoder to send it to
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
        inputs = DraftInputs(self._runner.layout(spans), torch.tensor(hidden_rows, dtype=torch.long))
        out = self._runner.run_draft(inputs)
        if drafting:
            drafts = self._runner.logits(out).argmax(dim=-1).tolist()
            for (req, at), d in zip(drafting, drafts, strict=True):
                req.mtp_draft, req.mtp_draft_at = int(d), at

    def _seed_drafts(self) -> None:
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
        inputs = DraftInputs(self._runner.layout(spans), torch.empty(0, dtype=torch.long), hidden, counted=False)
        drafts = self._runner.logits(self._runner.run_draft(inputs)).argmax(dim=-1).tolist()
        for r, k, d in zip(seeds, n, drafts, strict=True):
            r.mtp_draft, r.mtp_draft_at = int(d), k

    def _apply(self, sched: SchedulerOutput, picks: dict[int, _Picked]) -> list[RequestOutput]:
        outputs = []
        for c in sched.chunks:
            req = c.request
            if c.draft:
                p = picks[id(c)]
                req.num_computed += len(p.tokens)  # its next token and the accepted drafts now have KV
                outputs.append(self._append_tokens(req, p.tokens, p.logprobs))
                self._scheduler.trim(req)  # pages past the rejected positions go back
                continue
            req.num_computed += c.length
            if req.kind is RequestKind.PREFILL_ONLY and c.completes:
                self._scheduler.mark_prefilled(req)
                outputs.append(
                    RequestOutput(request_id=req.request_id, finished=True, finish_reason=FinishReason.PREFILLED)
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
            logprobs=tuple(lp for o in outs for lp in o.logprobs),
            drafts=(req.spec.proposed, req.spec.accepted),
        )

    def _append_token(self, req: Request, token: int, logprobs: TokenLogprobs | None) -> RequestOutput:
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
            request_id=req.request_id,
            new_token_ids=[token],
            output_ids=list(req.output_ids),
            finished=reason is not None,
            finish_reason=reason,
            text=delta,
            prompt_tokens=len(req.prompt_ids),
            logprobs=(logprobs,) if logprobs is not None else (),
            drafts=(req.spec.proposed, req.spec.accepted),
        )

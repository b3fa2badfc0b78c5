"""The engine: requests in, tokens out, one ``step()`` at a time.

``LLMEngine`` owns the model (this rank's shard), the paged KV cache, the page allocator, the scheduler
and the per-layer progress counter; all of them are private. Its rooms: ``loader`` (dtype, weights,
the CPU fast path), ``intake`` (validation), ``speculator`` (drafting and verification, injected at
construction), ``outputs`` (picking tokens, stop checks, finishing requests). It never imports Triton,
the messenger or the serving runtime: connectors and TP glue drive it through the port that
``torch_engine/connector.py`` documents (``ConnectorPort``, ``FollowerPort``), clients through ``add_request``
/ ``step`` / ``generate`` / ``stream``, monitors through ``load`` / ``page_stats`` / ``queue_depths`` / ``describe``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from torch_engine.config import EngineConfig, EngineManifest, SpecMethod
from torch_engine.connector import (
    Accepted,
    Admission,
    EngineLoad,
    KVExport,
    PlaceFn,
    Placement,
    PrefillResult,
    RefusalReason,
    Refused,
    Reserved,
    StepObserver,
    TickHook,
)
from torch_engine.decode_graphs import DecodeGraphs
from torch_engine.guided import Guide
from torch_engine.intake import Intake
from torch_engine.kernels import cpu_kernels
from torch_engine.layer_progress import LayerProgress
from torch_engine.loader import EngineDescription, kernel_path, load_weights, prepare_cpu_path, run_dtype, weight_bytes
from torch_engine.model_runner import ModelRunner
from torch_engine.models import kv_cache
from torch_engine.outputs import Outputs
from torch_engine.pages import PageAllocator, PageStats
from torch_engine.parallel import TPGroup
from torch_engine.prefix_cache import NO_CACHE, CacheEvents, CacheStats, PrefixCache, cache_identity
from torch_engine.request import FinishReason, Request, RequestKind, RequestOutput, RequestState
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.scheduler import Scheduler
from torch_engine.speculative import SpecStats
from torch_engine.speculator import Speculator
from torch_engine.steps import StepInputs
from torch_engine.tokenizer import Tokenizer


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tp: TPGroup | None = None,
        load_tokenizer: bool = True,
        speculator: Speculator | None = None,
    ) -> None:
        self._config = config
        self._manifest = manifest = EngineManifest.load(config.engine_dir)
        self._tp = tp or TPGroup.single()
        if self._tp.size != manifest.tp_size:
            raise ValueError(f"engine {config.engine_dir} was built for TP {manifest.tp_size}, not {self._tp.size}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        mc = manifest.model
        self._device = torch.device(config.device)
        self._dtype = run_dtype(config, manifest, self._device)
        self._page_size = config.page_size or manifest.page_size
        self._max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        fast = (config.fast_cpu or config.dtype == "auto") and self._device.type == "cpu"
        self._model = load_weights(manifest, config, self._tp, self._device, self._dtype, keep_packed=fast)
        self._prepacked = fast and prepare_cpu_path(self._model, self._device, self._dtype)
        layout = config.kv_layout or manifest.kv_layout
        graphs = config.decode_graphs if config.decode_graphs is not None else self._device.type == "cuda"
        graphs = graphs and self._tp.size == 1 and not mc.n_routed_experts
        pool_pages = config.num_pages + int(graphs)  # + the decode graphs' scratch page, outside the allocator
        self._kv = kv_cache(config, mc, self._tp.size, pool_pages, self._page_size, layout, self._dtype, self._device)
        self._kv.kernels = cpu_kernels() if fast else None
        self._progress = LayerProgress(mc.num_kv_layers, self._device)
        self._spec = speculator or Speculator(config.speculative, self._max_model_len)
        if self._spec.mtp and self._model.mtp is None:
            raise ValueError(
                f"speculative method {SpecMethod.MTP.value} needs a checkpoint with an MTP module "
                f"(num_nextn_predict_layers); the engine in {config.engine_dir} has none"
            )
        pc = config.prefix_cache
        self._allocator = PageAllocator(config.num_pages, pc.max_cached_pages)
        self._identity = cache_identity(manifest.fingerprint, self._dtype, self._kv.spec.dtype, layout)
        needs_mtp = self._spec.reads_mtp_kv if self._model.mtp is not None else None
        self._cache = PrefixCache(self._allocator, self._page_size, self._identity, needs_mtp) if pc.enabled else None
        s = config.scheduler
        propose = self._spec.propose if self._spec.drafts else None
        self._scheduler = Scheduler(
            self._allocator, self._page_size, s.max_num_seqs, s.max_num_batched_tokens, s.max_prefill_chunk, propose,
            self._cache, s.head_of_line_steps,
        )  # fmt: skip
        self._runner = ModelRunner(self._model, self._kv, self._progress, self._tp, self._device, self._max_model_len)
        if graphs:
            self._runner.use_decode_graphs(config.num_pages, s.max_num_seqs)
        self._runner.use_fused_step(config.fused_decode if fast else False)
        self._tokenizer = Tokenizer(config.engine_dir) if load_tokenizer and manifest.has_tokenizer else None
        eos = set(mc.eos_token_ids) | set(self._tokenizer.eos_token_ids if self._tokenizer else ())
        self._outputs = Outputs(self._scheduler, self._tokenizer, eos, self._max_model_len, self._kv.kernels)
        self._intake = Intake(self._tokenizer, mc.vocab_size, self._max_model_len, self._page_size, config.num_pages)
        self._requests: dict[str, Request] = {}
        self._observers: list[StepObserver] = []

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine directory's tokenizer (None: none shipped, or not loaded on this rank)."""
        return self._tokenizer

    @property
    def spec_stats(self) -> SpecStats:
        """Draft tokens proposed / accepted by this engine."""
        return self._spec.stats

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
        self._outputs.watch(req)
        self._requests[req.request_id] = req
        if kind is RequestKind.PREFILL_ONLY and req.compute_target == 0:
            req.state = RequestState.PREFILLED  # a one-token prompt has no KV to prefill
            self._scheduler.prefilled[req.request_id] = req
        else:
            self._scheduler.add(req)
        return req.request_id

    def admit_for_kv(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, place: PlaceFn
    ) -> Admission:
        """The decode side's one admission call (``connector.py``, step 1): validate once, report the
        load, ask ``place`` where the prompt is prefilled, and take it there. Never raises for the
        request's own sake: a prompt this engine cannot take is ``Refused(INVALID)``, one that finds
        too few free pages for its KV ``Refused(NO_ROOM)``."""
        load = self.load()
        try:
            req = self._new_request(prompt_ids, params, request_id, RequestKind.DECODE_FROM_KV, False)
        except InvalidRequestError as exc:
            return Refused(request_id, RefusalReason.INVALID, str(exc), load)
        hit = self._cache.match(req) if self._cache is not None else []  # the decoder's own cache first
        uncached = len(req.prompt_ids) - self._scheduler.reused(req, hit)  # a full hit moves no KV; nor does scoring
        where = place(load, uncached) if uncached > 1 and req.params.prompt_logprobs is None else Placement.LOCAL
        if where is Placement.HOLD:
            return Accepted(request_id, where, load)
        if where is Placement.LOCAL:
            req.kind = RequestKind.GENERATE
            self._requests[request_id] = req
            self._scheduler.add(req)
            self._outputs.watch(req)
            return Accepted(request_id, where, load)
        n = len(req.prompt_ids) - 1
        if not self._scheduler.can_reserve(n, hit):
            return Refused(request_id, RefusalReason.NO_ROOM, f"not enough free KV pages for {n} tokens now", load)
        self._requests[request_id] = req
        self._outputs.watch(req)
        self._scheduler.reserve(req, n, hit)
        fresh = req.pages[len(hit) :]
        self._allocator.pin(fresh)  # the connector's hold: until no write can land (``unpin_pages``)
        return Reserved(request_id, fresh, load, len(hit))

    def replace_kv_pages(self, request_id: str) -> list[int]:
        """A reserved request's KV will come from another sender into fresh pages: allocate and pin
        new pages (``InvalidRequestError`` when the pool has too few free), free the old ones (the
        free waits for the caller's pins: a write may still land there). Returns the new pages."""
        req = self._get(request_id)
        if req.state is not RequestState.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV (state {req.state.name})")
        cached = req.pages[: req.cache_registered]  # the decoder's own prefix stays: nobody writes it
        if not self._scheduler.can_reserve(len(req.prompt_ids) - 1, cached):
            raise InvalidRequestError(f"not enough free KV pages to move request {request_id} to fresh pages")
        self._scheduler.replace_reserved(req)
        return req.pages[len(cached) :]

    def kv_ready(self, request_id: str, last_hidden: torch.Tensor | None = None) -> None:
        """All KV of a reserved request has landed: it joins the batch and runs its last prompt token.
        ``last_hidden``: the prefill's final hidden state at its last position (``prompt[-2]``); an
        engine that drafts with MTP drafts from it before the first step, which then verifies a
        draft (``wants_prefill_hidden``)."""
        req = self._get(request_id)
        if req.state is not RequestState.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV (state {req.state.name})")
        size = self._manifest.model.hidden_size
        if last_hidden is not None and tuple(last_hidden.shape) != (size,):
            raise ValueError(
                f"request {request_id}: a last hidden state of shape {tuple(last_hidden.shape)}, not ({size},)"
            )
        self._scheduler.kv_ready(req)
        self._spec.seed(req, last_hidden)

    @property
    def wants_prefill_hidden(self) -> bool:
        """This engine drafts with MTP: a split request's first step can verify a draft made from
        the prefill's last hidden state (ask the prefill node for it)."""
        return self._spec.mtp

    def kv_failed(self, request_id: str, error: str) -> None:
        self._outputs.finish(self._get(request_id), RequestState.FAILED, FinishReason.ERROR, error)

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
        self._outputs.finish(req, RequestState.FINISHED, FinishReason.PREFILLED)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; returns False if it is unknown or already over."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self._outputs.finish(req, RequestState.ABORTED, FinishReason.ABORT)
        return True

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._spec.seed_drafts(self._runner)
        sched = self._scheduler.schedule()
        if not sched.chunks:
            return []
        for obs in self._observers:
            obs.before_step(sched)
        masks = self._outputs.prefetch(sched)  # grammar masks, computed while the forward pass runs
        picks = self._outputs.pick(sched, self._runner.run(sched), self._runner.logits, self._spec, masks)
        if self._model.mtp is not None:
            self._spec.draft_pass(sched, picks, self._runner, len(self._scheduler.running))
        for obs in self._observers:
            obs.after_forward(sched)
        return self._outputs.apply(sched, picks)

    def has_unfinished(self) -> bool:
        s = self._scheduler
        return bool(s.waiting or s.running)

    # -- monitors ------------------------------------------------------------------------
    def page_stats(self) -> PageStats:
        return self._allocator.stats()

    def describe(self) -> EngineDescription:
        """What this engine is (benchmarks and reports): model, dtype, pages, compute path, sizes."""
        spec, mc = self._kv.spec, self._manifest.model
        path = kernel_path(
            self._model, self._device, self._dtype, self._prepacked, self._kv.kernels is not None,
            self._runner.graphs is not None, self._runner.fused is not None,
        )  # fmt: skip
        return EngineDescription(
            source=self._manifest.source,
            model=mc,
            tp_size=self._tp.size,
            device=str(self._device),
            dtype=self._dtype,
            kv_dtype=spec.dtype,
            page_size=self._page_size,
            num_pages=self._allocator.num_pages,
            max_model_len=self._max_model_len,
            kernel_path=path,
            weight_bytes=weight_bytes(self._model),
            kv_bytes_per_token=sum(p[0].numel() * p.element_size() for p in self._kv.pools) // spec.page_size,
            cache_identity=self._identity,
        )

    @property
    def kernel_path(self) -> str:
        return self.describe().kernel_path

    def cache_stats(self) -> CacheStats:
        """The prefix cache's size and hit counts (zeros when it is off)."""
        return self._cache.stats() if self._cache is not None else NO_CACHE

    def cache_events(self, since: int) -> CacheEvents:
        """Prefix-cache events after ``since``, or a snapshot (``PrefixCache.events_since``)."""
        return self._cache.events_since(since) if self._cache is not None else CacheEvents(0)

    def clear_prefix_cache(self) -> int:
        return self._cache.clear() if self._cache is not None else 0  # unheld cached pages evicted

    def decode_graphs_stats(self) -> DecodeGraphs | None:
        """The decode-graph buckets (``replays``, ``captured``), or None when this engine runs eagerly."""
        return self._runner.graphs

    def queue_depths(self) -> tuple[int, int]:  # (waiting, running) requests
        return len(self._scheduler.waiting), len(self._scheduler.running)

    def load(self) -> EngineLoad:
        """What the engine has on its hands now (a decode node's placement rule reads it)."""
        return EngineLoad(*self._scheduler.load(), self._config.scheduler.max_num_batched_tokens)

    # -- the connector port (torch_engine/connector.py) ----------------------------------
    def attach(self, observer: StepObserver) -> None:
        """Call ``observer`` before every step and after its forward pass."""
        self._observers.append(observer)

    def kv_export(self) -> KVExport:
        """The messenger's view of this rank's KV: pools, spec, progress counter, TP rank."""
        mc, kv, tp = self._manifest.model, self._kv, self._tp
        return KVExport(kv.pools, kv.spec, self._progress, tp.rank, tp.size, mc.num_kv_heads, mc.hidden_size)

    def next_forward(self) -> int:
        """The layer counter value the next forward pass reaches (``progress.completed(layer)`` of
        every layer equals it once that pass has run)."""
        return self._progress.completed(self._progress.num_layers - 1) + 1

    def pin_pages(self, pages: list[int]) -> None:
        """Hold pages against reuse (a transfer reads or writes them); the scheduler never preempts a
        request with pinned pages, and freeing a pinned page waits for its last ``unpin_pages``."""
        self._allocator.pin(pages)

    def unpin_pages(self, pages: list[int]) -> None:
        self._allocator.unpin(pages)

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

    # -- the follower port ---------------------------------------------------------------
    def tp_group(self) -> TPGroup:
        """This rank's TP group (the TP glue's tick protocol rides on its collectives)."""
        return self._tp

    def set_tick_hook(self, hook: TickHook | None) -> None:
        """TP leader: wrap each step's broadcast (the messenger's commands ride along)."""
        self._runner.tick_hook = hook

    def execute_step(self, inputs: StepInputs) -> None:
        """TP follower: run one broadcast step (the leader's ``TickHook`` wrapped it)."""
        self._runner.execute(inputs)

    def shutdown(self) -> None:
        """Leader: release the TP followers from ``run_follower``."""
        self._runner.stop_followers()

    def run_follower(self, on_message: Callable[[object], None] | None = None) -> None:
        """TP ranks > 0: execute every step the leader broadcasts until it shuts down (``on_message``
        handles what a ``TickHook`` on the leader wraps the steps in)."""
        if self._tp.is_leader:
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
        self, prompt: str | Sequence[int], params: SamplingParams | None, rid: str | None, kind: RequestKind, chat: bool
    ) -> Request:
        return self._intake.new(prompt, params, rid, kind, chat, self._requests)

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Raise ``InvalidRequestError`` naming the problem if this engine cannot take the prompt."""
        self._intake.check(ids)

    def prepare_guide(self, guide: Guide) -> None:
        """Compile a guide for this tokenizer now, from any thread (the loop then only copies it)."""
        self._intake.prepare_guide(guide)

    def _get(self, request_id: str) -> Request:
        if (req := self._requests.get(request_id)) is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

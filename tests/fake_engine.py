"""A small fake engine: the engine port (``ConnectorPort``, ``FollowerPort``) over a page allocator
and a few zero KV pools, with no model. It counts every call, so tests can see how a connector or
the request path drives an engine (what, how often, in which order)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from torch_engine.config import KVLayout
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
from torch_engine.kv_cache import KVCacheSpec
from torch_engine.layer_progress import LayerProgress
from torch_engine.pages import PageAllocator
from torch_engine.parallel import TPGroup
from torch_engine.request import Request, RequestKind, RequestOutput, RequestState
from torch_engine.sampling import SamplerState, SamplingParams
from torch_engine.steps import StepInputs

VOCAB = 256


@dataclass
class FakeEngine:
    num_pages: int = 16
    page_size: int = 4
    calls: Counter[str] = field(default_factory=Counter)
    requests: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.allocator = PageAllocator(self.num_pages)
        self.spec = KVCacheSpec(2, self.num_pages, self.page_size, KVLayout.HND, torch.float32, kv_heads=1, head_dim=4)
        self.pools = [torch.zeros(self.num_pages, *self.spec.page_shape) for _ in range(self.spec.num_layers)]
        self.progress = LayerProgress(self.spec.num_layers, torch.device("cpu"))
        self.observers: list[StepObserver] = []

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- ConnectorPort -------------------------------------------------------------------
    def admit_for_kv(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, place: PlaceFn
    ) -> Admission:
        self.calls["admit_for_kv"] += 1
        load = self.load()
        bad = next((t for t in prompt_ids if not 0 <= t < VOCAB), None)
        if not prompt_ids or bad is not None:
            return Refused(request_id, RefusalReason.INVALID, f"prompt token id {bad} is outside the vocabulary", load)
        where = place(load, len(prompt_ids)) if len(prompt_ids) > 1 else Placement.LOCAL
        req = Request(
            request_id=request_id, prompt_ids=list(prompt_ids), params=params, kind=RequestKind.DECODE_FROM_KV,
            sampler=SamplerState.seeded(0),
        )  # fmt: skip
        if where is Placement.HOLD:
            return Accepted(request_id, where, load)
        if where is Placement.LOCAL:
            req.kind = RequestKind.GENERATE
            self.requests[request_id] = req
            return Accepted(request_id, where, load)
        n = self._pages_for(len(prompt_ids) - 1)
        if not self.allocator.can_allocate(n):
            return Refused(request_id, RefusalReason.NO_ROOM, "no room", load)
        req.pages = self.allocator.allocate(n)
        self.allocator.pin(req.pages)  # the engine's own hold until kv_ready
        self.allocator.pin(req.pages)  # the connector's
        req.state = RequestState.WAITING_FOR_KV
        self.requests[request_id] = req
        return Reserved(request_id, list(req.pages), load)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kind: RequestKind = RequestKind.GENERATE,
        want_last_hidden: bool = False,
        chat: bool = False,
    ) -> str:
        self.calls["add_request"] += 1
        rid = request_id or f"fake-{len(self.requests)}"
        ids = [int(t) for t in prompt] if not isinstance(prompt, str) else [1]
        self.requests[rid] = Request(
            request_id=rid, prompt_ids=ids, params=params or SamplingParams(), kind=kind,
            sampler=SamplerState.seeded(0),
        )  # fmt: skip
        return rid

    def replace_kv_pages(self, request_id: str) -> list[int]:
        self.calls["replace_kv_pages"] += 1
        req = self.requests[request_id]
        old = req.pages
        req.pages = self.allocator.allocate(len(old))
        self.allocator.pin(req.pages)
        self.allocator.unpin(old)
        self.allocator.free(old)
        return list(req.pages)

    @property
    def wants_prefill_hidden(self) -> bool:
        return False

    def attach(self, observer: StepObserver) -> None:
        self.observers.append(observer)

    def next_forward(self) -> int:
        return self.progress.completed(self.spec.num_layers - 1) + 1

    def step(self) -> list[RequestOutput]:
        self.calls["step"] += 1
        return []

    def kv_ready(self, request_id: str, last_hidden: torch.Tensor | None = None) -> None:
        self.calls["kv_ready"] += 1
        req = self.requests[request_id]
        self.allocator.unpin(req.pages)
        req.state = RequestState.RUNNING

    def kv_failed(self, request_id: str, error: str) -> None:
        self.calls["kv_failed"] += 1
        self._end(self.requests[request_id], RequestState.FAILED)

    def prefill_result(self, request_id: str) -> PrefillResult:
        req = self.requests[request_id]
        return PrefillResult(request_id, list(req.pages), len(req.prompt_ids) - 1, None, None)

    def release(self, request_id: str) -> None:
        self._end(self.requests[request_id], RequestState.FINISHED)

    def abort(self, request_id: str) -> bool:
        self.calls["abort"] += 1
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._end(req, RequestState.ABORTED)
        return True

    def retire(self, request_id: str) -> Request | None:
        self.abort(request_id)
        return self.requests.pop(request_id, None)

    def pin_pages(self, pages: list[int]) -> None:
        self.allocator.pin(pages)

    def unpin_pages(self, pages: list[int]) -> None:
        self.allocator.unpin(pages)

    def kv_export(self) -> KVExport:
        return KVExport(self.pools, self.spec, self.progress, 0, 1, self.spec.kv_heads, 8)

    def load(self) -> EngineLoad:
        waiting = sum(1 for r in self.requests.values() if r.state is RequestState.WAITING_FOR_KV)
        return EngineLoad(waiting, 0.0, 0, 64)

    def _end(self, req: Request, state: RequestState) -> None:
        if req.state is RequestState.WAITING_FOR_KV:
            self.allocator.unpin(req.pages)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        req.state = state

    # -- FollowerPort --------------------------------------------------------------------
    def tp_group(self) -> TPGroup:
        return TPGroup.single()

    def set_tick_hook(self, hook: TickHook | None) -> None:
        self.calls["set_tick_hook"] += 1

    def execute_step(self, inputs: StepInputs) -> None:
        self.calls["execute_step"] += 1

    def run_follower(self, on_message: Callable[[object], None] | None = None) -> None:
        raise RuntimeError("a TP-1 fake has no followers")

    def shutdown(self) -> None:
        pass

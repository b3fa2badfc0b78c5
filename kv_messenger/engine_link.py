"""Glue between an ``LLMEngine`` and a messenger side. The engine never imports the messenger.

``PrefillLink`` (prefill node, TP leader or TP 1): turns ``PrefillRequest``s into prefill-only
engine requests, tells the messenger which chunks each step runs (``before_step``, before the
forward pass), pins the source pages while they are being sent, hands over the last hidden
state + logits, and releases the pages when every write completed.

``DecodeLink`` (decode node): reserves and pins destination pages, tells the messenger what to
expect, builds the ``PrefillRequest`` to send, and each step moves requests whose KV landed
into the batch (``kv_ready``) or fails them (``kv_failed``). Pages of a failed request return
to the pool only when the messenger says no write can still land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kv_messenger.decode_side import DecodePoll, DecodeSide
from kv_messenger.layout import AttentionKind, KVLayoutSpec
from kv_messenger.prefill_side import PrefillJobState, PrefillOutcome, PrefillSide
from kv_messenger.protocol import PrefillRequest
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason, RequestKind, RequestOutput
from torch_engine.sampling import SamplingParams
from torch_engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from kv_messenger.tp_group import GroupDecodeSide, GroupPrefillSide


def engine_layout(engine: LLMEngine) -> KVLayoutSpec:
    """The messenger's view of an engine's KV pools."""
    spec, mc = engine.kv.spec, engine.manifest.model
    common = {
        "num_layers": spec.num_layers,
        "page_size": spec.page_size,
        "layout": spec.layout,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "tp_size": engine.tp.size,
        "tp_rank": engine.tp.rank,
    }
    if spec.is_mla:
        return KVLayoutSpec(kind=AttentionKind.MLA, latent_dim=spec.latent_dim, **common)
    return KVLayoutSpec(kind=AttentionKind.GQA, kv_heads=mc.num_kv_heads, head_dim=spec.head_dim, **common)


def metadata_bytes(engine: LLMEngine) -> int:
    """Size of the metadata a prefill hands over: last hidden state + last logits, fp32."""
    mc = engine.manifest.model
    return (mc.hidden_size + mc.vocab_size) * 4


class PrefillLink:
    def __init__(self, engine: LLMEngine, side: PrefillSide | GroupPrefillSide) -> None:
        self.engine = engine
        self.side = side
        self._pinned: dict[str, list[int]] = {}
        self._wants_meta: set[str] = set()
        self._reaped: list[PrefillOutcome] = []
        engine.observers.append(self)

    def submit(self, req: PrefillRequest) -> None:
        self.engine.add_request(
            req.prompt_ids,
            request_id=req.request_id,
            kind=RequestKind.PREFILL_ONLY,
            want_last_hidden=req.meta_slot is not None,
        )
        self.side.submit(req)
        self._pinned[req.request_id] = []
        if req.meta_slot is not None:
            self._wants_meta.add(req.request_id)

    def before_step(self, sched: SchedulerOutput) -> None:
        forward = self.engine.progress.completed(self.engine.progress.num_layers - 1) + 1
        for c in sched.chunks:
            pinned = self._pinned.get(c.request.request_id)
            if pinned is None:
                continue
            fresh = c.request.pages[len(pinned) :]
            self.engine.allocator.pin(fresh)  # the scheduler never preempts a request with pinned pages
            pinned += fresh
            self.side.schedule(c.request.request_id, forward, c.start + c.length, c.completes, c.request.pages)

    def step(self) -> list[RequestOutput]:
        """One engine step plus the messenger bookkeeping; returns the engine's outputs."""
        outputs = self.engine.step()
        for out in outputs:
            if out.finish_reason is FinishReason.PREFILLED and out.request_id in self._pinned:
                self.side.prefill_done(out.request_id)
            if out.finish_reason is FinishReason.PREFILLED and out.request_id in self._wants_meta:
                req = self.engine.requests[out.request_id]
                assert req.last_hidden is not None and req.last_logits is not None
                payload = torch.cat((req.last_hidden.float(), req.last_logits.float()))
                self.side.set_metadata(out.request_id, payload)
        self._reaped += self._release()
        return outputs

    def reap(self) -> list[PrefillOutcome]:
        """Release the source pages of requests whose transfers are over; returns them (including
        those that ``step`` already released since the last call)."""
        done, self._reaped = self._reaped + self._release(), []
        return done

    def _release(self) -> list[PrefillOutcome]:
        done = []
        for outcome in self.side.completed():
            rid = outcome.request_id
            self.engine.allocator.unpin(self._pinned.pop(rid, []))
            self._wants_meta.discard(rid)
            if outcome.state is PrefillJobState.DONE:
                self.engine.release(rid)
            else:
                self.engine.abort(rid)
            self.engine.requests.pop(rid, None)
            done.append(outcome)
        return done

    def abort(self, request_id: str) -> None:
        self.side.abort(request_id)  # pages come back through reap() once no write is in flight


class DecodeLink:
    def __init__(
        self,
        engine: LLMEngine,
        side: DecodeSide | GroupDecodeSide,
        prefill_agents: list[str] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.side = side
        self.prefill_agents = prefill_agents or []  # default senders; ``start`` may name others per request
        self.decode_agents = side.agents  # the decode group's ranks, by TP rank
        self.timeout_s = timeout_s
        self._epochs: dict[str, int] = {}
        self._slots = list(range(side.meta_slots))
        self._slot_of: dict[str, int] = {}
        self._pages: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._meta: dict[str, torch.Tensor] = {}

    def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        seed: int = 0,
        meta: bool = False,
        prefill_agents: list[str] | None = None,
    ) -> PrefillRequest:
        """Reserve pages and start counting; returns the request to send to the prefill node."""
        rid, pages = self.engine.reserve_for_kv(prompt_ids, params, request_id)
        self.engine.allocator.pin(pages)  # held until no write can land, whatever the engine does
        slot = self._slots.pop() if meta and self._slots else None
        if slot is not None:
            self._slot_of[rid] = slot
        self._pages[rid] = pages
        self._prompts[rid] = list(prompt_ids)
        try:
            return self._expect(rid, seed, prefill_agents or self.prefill_agents)
        except ValueError:  # e.g. senders not connected: nothing was sent, undo the reservation
            self.engine.allocator.unpin(self._pages.pop(rid))
            self._prompts.pop(rid, None)
            self._free_slot(rid)
            self.engine.abort(rid)
            self.engine.requests.pop(rid, None)
            raise

    def retarget(self, request_id: str, prefill_agents: list[str], seed: int = 0) -> PrefillRequest:
        """The prefill request never reached its group (the call failed): same pages, a new epoch,
        other senders. Only for requests whose transfer cannot have started."""
        self.side.forget(request_id)
        return self._expect(request_id, seed, prefill_agents)

    def _expect(self, rid: str, seed: int, prefill_agents: list[str]) -> PrefillRequest:
        epoch = self._epochs.get(rid, -1) + 1
        self._epochs[rid] = epoch
        slot = self._slot_of.get(rid)
        pages = self._pages[rid]
        self.side.expect(rid, epoch, prefill_agents, len(pages), seed, slot is not None, self.timeout_s)
        return PrefillRequest(
            request_id=rid,
            epoch=epoch,
            prompt_ids=self._prompts[rid],
            dst_pages=pages,
            decode_ranks=self.decode_agents,
            seed=seed,
            meta_slot=slot,
        )

    def waiting(self) -> bool:
        """Some request still waits for its KV or for its pages to become reusable."""
        return bool(self._pages)

    def metadata(self, request_id: str) -> torch.Tensor | None:
        """The prefill's last hidden state + logits (fp32, concatenated), once the request is ready."""
        return self._meta.get(request_id)

    def poll(self) -> list[tuple[str, str]]:
        """Move landed requests into the batch; returns the failed ones with their errors."""
        return self.poll_all().failed

    def fail_undelivered(self, request_id: str, error: str) -> None:
        """The prefill request could not be delivered anywhere: no write can come; free everything now."""
        self.side.forget(request_id)
        self.engine.allocator.unpin(self._pages.pop(request_id, []))
        self._prompts.pop(request_id, None)
        self._free_slot(request_id)
        self.engine.kv_failed(request_id, error)

    def poll_all(self) -> DecodePoll:
        """``poll``, returning what became ready, failed and releasable."""
        polled = self.side.poll()
        for rid in polled.ready:
            self.engine.allocator.unpin(self._pages.pop(rid))
            self._prompts.pop(rid, None)
            slot = self._slot_of.get(rid)
            if slot is not None:
                n = metadata_bytes(self.engine)
                self._meta[rid] = self.side.meta_slot(slot)[:n].view(torch.float32).clone()
                self._free_slot(rid)
            self.engine.kv_ready(rid)
        for rid, error in polled.failed:
            self.engine.kv_failed(rid, error)  # pages stay pinned (not reusable) until releasable
        for rid in polled.releasable:
            self.engine.allocator.unpin(self._pages.pop(rid))
            self._prompts.pop(rid, None)
            self._free_slot(rid)
        return polled

    def abort(self, request_id: str) -> None:
        self.side.abort(request_id)
        self.engine.abort(request_id)

    def _free_slot(self, rid: str) -> None:
        slot = self._slot_of.pop(rid, None)
        if slot is not None:
            self._slots.append(slot)

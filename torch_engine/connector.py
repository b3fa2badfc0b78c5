"""The engine's one port for disaggregation: how a KV connector and a TP follower drive an engine.

A leaf of the engine: its types and Protocols import nothing of the engine's implementation.
``LLMEngine`` implements ``ConnectorPort`` and ``FollowerPort``; everything outside
``torch_engine/`` that takes part in a split request (``serving.kv_links``, ``serving.decode_path``,
``serving.tp_group``, ``serving.bootstrap``) is typed against these Protocols, never against the
engine class, and is tested against a small fake engine (``tests/fake_engine.py``).

Call order, per request (who calls what):

1. **admit** (connector -> engine).
   Decode side: ``admit_for_kv(prompt, params, request_id, place)`` validates the prompt once,
   matches it against the engine's own prefix cache (decode-first reuse), reads the engine's
   load, asks ``place(load, uncached_tokens)`` where the rest is prefilled (a full hit is
   ``LOCAL`` without asking: no KV moves), and returns what it did as data: ``Reserved`` (the
   cached prefix's ``first_page`` pages shared; pages for the rest of ``prompt[:-1]`` reserved
   *and pinned*: held until no write can land, whatever happens to the request; the prefill node
   writes only those), ``Accepted`` (``LOCAL``: the
   engine prefills it itself, as colocated; ``HOLD``: validated, nothing taken) or ``Refused``
   (``INVALID``: never fits; ``NO_ROOM``: too few free pages now).
   Prefill side: ``add_request(prompt, request_id=..., kind=PREFILL_ONLY, want_last_hidden=...)``.
2. **before step** (engine -> connector): ``before_step(sched)`` on every attached connector,
   before the forward pass, with the chunks that run in it. ``next_forward()`` is the layer
   counter's value that this forward pass will reach, so the connector (prefill side) can tell
   the messenger which forward completes which pages; it pins freshly filled source pages here.
3. **around the step** (engine -> tick hook; TP groups only): the leader's ``TickHook.wrap``
   turns the step's inputs into what is broadcast (the messenger's commands ride along) and
   ``TickHook.after`` runs once every rank ran the step (``set_tick_hook``). Followers run the
   broadcast steps with ``run_follower`` / ``execute_step`` (``FollowerPort``).
4. **after forward** (engine -> connector): ``after_forward(sched)``, every layer of the step is
   done (benchmarks time forward passes here).
5. **poll** (serving loop -> connector, between steps) -> ``ConnectorPoll(ready, failed,
   releasable)``; the connector applies it through the engine:
   ready -> ``kv_ready(id)`` (the request joins the batch; its first step runs the last prompt
   token); failed -> ``kv_failed(id, error)``; releasable -> ``unpin_pages(pages)`` (no write can
   land any more). Prefill side: ``prefill_result(id)`` for the metadata hand-off, then
   ``release(id)`` or ``abort(id)`` once every write completed, ``unpin_pages``, ``retire(id)``.

The messenger reads the KV pools through ``kv_export()`` only (pools, their spec, the layer
counter, the TP rank, and the two model sizes a layout descriptor needs). Failures travel as data
(``ConnectorPoll.failed``, ``Refused``), never as exceptions out of ``poll`` or ``admit_for_kv``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from torch_engine.kv_cache import KVCacheSpec
    from torch_engine.layer_progress import LayerProgress
    from torch_engine.parallel import TPGroup
    from torch_engine.request import Request, RequestKind, RequestOutput
    from torch_engine.sampling import SamplingParams
    from torch_engine.scheduler import SchedulerOutput
    from torch_engine.steps import StepInputs


class StepObserver(Protocol):
    """Told what runs in each step (``before_step``) and when its forward pass ended (``after_forward``)."""

    def before_step(self, sched: SchedulerOutput) -> None: ...

    def after_forward(self, sched: SchedulerOutput) -> None: ...


class TickHook(Protocol):
    """Wraps what the TP leader broadcasts each step (step 3 of the call order)."""

    def wrap(self, inputs: StepInputs) -> object: ...  # broadcast instead of ``inputs``

    def after(self) -> None: ...  # every rank ran the step


@dataclass(slots=True)
class ConnectorPoll:
    """What a connector's ``poll`` found since the last one."""

    ready: list[str] = field(default_factory=list)  # every KV write landed
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, error)
    releasable: list[str] = field(default_factory=list)  # pages of failed / aborted requests: no write can land


# -- what the engine reports --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EngineLoad:
    decoding: int  # running requests past their first token
    mean_context: float  # their mean context (tokens)
    prefill_tokens: int  # prompt tokens still to compute, waiting and running requests
    chunk: int  # tokens per step (the scheduler's budget)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a finished prefill-only request leaves behind (its pages stay held until ``release``)."""

    request_id: str
    pages: list[int]
    num_tokens: int  # tokens of KV in the pages: the prompt minus its last token
    last_hidden: torch.Tensor | None
    last_logits: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class KVExport:
    """What the messenger may see of an engine: the KV pools it reads and writes, their spec, the
    per-layer progress counter it polls, this rank's place in its TP group, and the model's KV heads
    (all ranks) and hidden size (the metadata a prefill hands over is one fp32 hidden state)."""

    pools: list[torch.Tensor]
    spec: KVCacheSpec
    progress: LayerProgress
    tp_rank: int
    tp_size: int
    kv_heads: int
    hidden_size: int


# -- admission (step 1, decode side) ------------------------------------------------------
class Placement(enum.IntEnum):
    """Where an admitted prompt is prefilled (``admit_for_kv``'s ``place`` decides)."""

    REMOTE = 0  # at a prefill group: pages reserved and pinned for its KV
    LOCAL = 1  # on this engine, as a colocated request
    HOLD = 2  # not yet: validated, nothing taken (the caller queues it)


class RefusalReason(enum.IntEnum):
    INVALID = 0  # this engine can never take the prompt (the message names why)
    NO_ROOM = 1  # too few free KV pages to reserve now; retry when pages come back


@dataclass(frozen=True, slots=True)
class Reserved:
    """``REMOTE``: pages for the KV of ``prompt[:-1]`` are reserved and pinned for ``request_id``."""

    request_id: str
    pages: list[int]  # for the tokens past the decoder's cached prefix, in token order
    load: EngineLoad  # before this reservation
    first_page: int = 0  # pages of the prompt's start that the decoder's prefix cache already holds


@dataclass(frozen=True, slots=True)
class Accepted:
    """``LOCAL`` (the engine queued it) or ``HOLD`` (validated only)."""

    request_id: str
    placement: Placement
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class Refused:
    request_id: str
    reason: RefusalReason
    message: str
    load: EngineLoad


Admission = Reserved | Accepted | Refused
PlaceFn = Callable[[EngineLoad, int], Placement]  # (load, prompt tokens not in the decoder's cache) -> where


class ConnectorPort(Protocol):
    """The engine as a KV connector sees it (the call order above)."""

    # admit
    def admit_for_kv(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, place: PlaceFn
    ) -> Admission: ...

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kind: RequestKind = ...,
        want_last_hidden: bool = False,
        chat: bool = False,
    ) -> str: ...

    def replace_kv_pages(self, request_id: str) -> list[int]: ...

    @property
    def wants_prefill_hidden(self) -> bool: ...

    # before / after the step
    def attach(self, observer: StepObserver) -> None: ...

    def next_forward(self) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    # poll
    def kv_ready(self, request_id: str, last_hidden: torch.Tensor | None = None) -> None: ...

    def kv_failed(self, request_id: str, error: str) -> None: ...

    def prefill_result(self, request_id: str) -> PrefillResult: ...

    def release(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def retire(self, request_id: str) -> Request | None: ...

    def pin_pages(self, pages: list[int]) -> None: ...

    def unpin_pages(self, pages: list[int]) -> None: ...

    # the messenger's view
    def kv_export(self) -> KVExport: ...

    def load(self) -> EngineLoad: ...


class FollowerPort(Protocol):
    """The engine as TP-group glue sees it: the leader's tick hook, a follower's step loop."""

    def tp_group(self) -> TPGroup: ...

    def set_tick_hook(self, hook: TickHook | None) -> None: ...

    def execute_step(self, inputs: StepInputs) -> None: ...

    def run_follower(self, on_message: Callable[[object], None] | None = None) -> None: ...

    def shutdown(self) -> None: ...

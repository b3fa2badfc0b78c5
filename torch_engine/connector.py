"""The engine's one port for disaggregation: how a KV connector drives an ``LLMEngine``.

A connector (``serving.kv_links``: ``PrefillLink`` on prefill nodes, ``DecodeLink`` on decode
nodes) is the only thing outside the engine that takes part in a split request. It uses these
public calls of ``LLMEngine`` and nothing else; the engine never imports a connector.

Call order, per request (who calls what):

1. **admit** (connector -> engine).
   Decode side: ``reserve_for_kv(prompt, params, request_id)`` -> pages, then
   ``pin_pages(pages)`` (held until no write can land, whatever happens to the request).
   Prefill side: ``add_request(prompt, request_id=..., kind=PREFILL_ONLY, want_last_hidden=...)``.
2. **before step** (engine -> connector): ``before_step(sched)`` on every attached connector,
   before the forward pass, with the chunks that run in it. ``next_forward()`` is the layer
   counter's value that this forward pass will reach, so the connector (prefill side) can tell
   the messenger which forward completes which pages; it pins freshly filled source pages here.
3. **around the step** (engine -> tick hook; TP groups only): the leader's ``TickHook.wrap``
   turns the step's inputs into what is broadcast (the messenger's commands ride along) and
   ``TickHook.after`` runs once every rank ran the step (``set_tick_hook``). Followers run the
   broadcast steps with ``run_follower`` / ``execute_step``.
4. **after forward** (engine -> connector): ``after_forward(sched)``, every layer of the step is
   done (benchmarks time forward passes here).
5. **poll** (serving loop -> connector, between steps) -> ``ConnectorPoll(ready, failed,
   releasable)``; the connector applies it through the engine:
   ready -> ``kv_ready(id)`` (the request joins the batch; its first step runs the last prompt
   token); failed -> ``kv_failed(id, error)``; releasable -> ``unpin_pages(pages)`` (no write can
   land any more). Prefill side: ``prefill_result(id)`` for the metadata hand-off, then
   ``release(id)`` or ``abort(id)`` once every write completed, ``unpin_pages``, ``retire(id)``.

Failures travel as data (``ConnectorPoll.failed``), never as exceptions out of ``poll``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from torch_engine.model_runner import StepInputs
    from torch_engine.scheduler import SchedulerOutput


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


PollT_co = TypeVar("PollT_co", covariant=True)


class KVConnector(StepObserver, Protocol[PollT_co]):
    """A connector attached to an engine (``LLMEngine.attach``): observes steps, is polled between
    them. Decode side: ``poll() -> ConnectorPoll``; prefill side: the finished transfers, whose
    source pages it has just released."""

    def poll(self) -> PollT_co: ...

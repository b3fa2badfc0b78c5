"""What a serving process runs, built from its ``NodeConfig``: used by the Triton backend (group
leaders) and by ``orchestrator.worker`` (TP followers). No Triton import here.

- standalone (no ``mpi_rank``): one engine, TP 1; a prefill node takes decode peers by handshake.
- in a deployment: ``rank.bootstrap`` (MPI exchange, TP group, messenger side), then
  decode leader -> ``EngineLoop`` (+ ``KVFetcher`` when disaggregated); prefill leader ->
  ``PrefillServer``; follower -> ``tp_group.run_follower``.
"""

from __future__ import annotations

import logging

from kv_messenger.prefill_server import DoneHook, PrefillServer
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.tp_group import run_follower
from kv_messenger.trace import TraceObserver, Tracer
from kv_messenger.transport.nixl import NixlTransport
from orchestrator.kv_fetch import KVFetcher
from orchestrator.node_config import NodeConfig
from orchestrator.rank import bootstrap
from torch_engine.config import Role
from torch_engine.engine import LLMEngine
from torch_engine.serving import EngineLoop, StepHook

log = logging.getLogger(__name__)


def _tracer(node: NodeConfig) -> Tracer | None:
    name = f"{node.role.value}{node.group}"
    return Tracer(node.trace_path, name) if node.trace_path is not None else None


def decode_loop(node: NodeConfig, on_step: StepHook | None = None) -> tuple[EngineLoop, Tracer | None]:
    """The engine loop of a decode (or colocated) group leader, and its tracer."""
    tracer = _tracer(node)
    if node.mpi_rank is None:
        return EngineLoop(LLMEngine(node.engine_config()), on_step=on_step), tracer
    rank = bootstrap(node)
    if tracer is not None:
        rank.engine.observers.append(TraceObserver(tracer))
    assert rank.channel is not None
    kv = None
    if node.role is Role.DECODE:
        side = rank.decode_side()
        groups = rank.prefill_groups()
        kv = KVFetcher(rank.engine, side, groups, node.kv_timeout_s, node.prefill_request_timeout_s, tracer)
    channel = rank.channel

    def on_exit() -> None:
        channel.stop()
        if kv is not None:
            kv.close()

    return EngineLoop(rank.engine, on_step=on_step, kv=kv, on_exit=on_exit), tracer


def prefill_server(node: NodeConfig, on_done: DoneHook | None = None) -> PrefillServer:
    if node.mpi_rank is None:
        engine = LLMEngine(node.engine_config(), load_tokenizer=False)
        return PrefillServer.standalone(engine, NixlTransport(node.agent_name, node.nixl_backend), on_done=on_done)
    rank = bootstrap(node)
    assert rank.channel is not None
    side, tracer = rank.prefill_side(), _tracer(node)
    if tracer is not None:
        rank.engine.observers.append(TraceObserver(tracer))
    return PrefillServer(rank.engine, side, on_done=on_done, on_exit=rank.channel.stop, tracer=tracer)


def follower(node: NodeConfig) -> None:
    """A TP follower rank's whole life: join, then run the leader's steps until it lets go."""
    rank = bootstrap(node)
    side = rank.local_side
    if isinstance(side, PrefillSide):
        side.start()  # this rank's messenger thread sends its shard as the layers finish
    try:
        run_follower(rank.engine, side)
    finally:
        if isinstance(side, PrefillSide):
            side.stop()

"""What a serving process runs, built from its ``NodeConfig``: used by the Triton backend (group
leaders) and by ``serving.worker`` (TP followers). No Triton import here.

- standalone (no ``mpi_rank``): one engine, TP 1; a prefill node takes decode peers by handshake.
- in a deployment: ``bootstrap.bootstrap`` (group-local MPI exchange, TP group, messenger side,
  the registry's records), then
  decode leader -> ``DecodeLoop`` (+ ``KVFetcher`` when disaggregated); prefill leader ->
  ``PrefillLoop``; follower -> ``tp_group.run_follower``.
"""

from __future__ import annotations

import logging

from kv_messenger.prefill_side import PrefillSide
from kv_messenger.transport.nixl import NixlTransport
from serving.bootstrap import bootstrap
from serving.decode_loop import DecodeLoop
from serving.decode_path import KVFetcher
from serving.loop import ReportHook
from serving.node_config import NodeConfig, group_name
from serving.prefill_loop import DoneHook, PrefillLoop
from serving.tp_group import run_follower
from serving.trace import TraceObserver, Tracer
from torch_engine.config import Role
from torch_engine.engine import LLMEngine

log = logging.getLogger(__name__)


def _tracer(node: NodeConfig) -> Tracer | None:
    name = group_name(node.role, node.group)
    return Tracer(node.trace_path, name) if node.trace_path is not None else None


def decode_loop(node: NodeConfig, on_report: ReportHook | None = None) -> tuple[DecodeLoop, Tracer | None]:
    """The engine loop of a decode (or colocated) group leader, and its tracer."""
    tracer = _tracer(node)
    pending, t = node.limits.max_pending, node.timeouts
    if node.mpi_rank is None:
        loop = DecodeLoop(
            LLMEngine(node.engine), on_report=on_report, max_pending=pending, first_token_s=t.first_token_s,
            stall_s=t.loop_stall_s,
        )  # fmt: skip
        return loop, tracer
    rank = bootstrap(node)
    if tracer is not None:
        rank.engine.attach(TraceObserver(tracer))
    assert rank.channel is not None
    kv = None
    if node.role is Role.DECODE:
        side = rank.decode_side()
        groups = rank.prefill_groups()
        kv = KVFetcher(
            rank.engine,
            side,
            groups,
            t.kv_transfer_s,
            t.prefill_request_s,
            tracer,
            auth_key=node.auth_key,
            membership=rank.membership(Role.PREFILL),
            placement=node.placement,
            head_of_line_s=t.head_of_line_s,
        )
    channel = rank.channel

    def on_exit() -> None:
        channel.stop()
        if kv is not None:
            kv.close()

    heartbeat = (lambda: channel.sync(False)) if kv is None and channel.tp.size > 1 else None  # colocated TP
    loop = DecodeLoop(
        rank.engine, on_report=on_report, kv=kv, on_exit=on_exit, heartbeat=heartbeat, max_pending=pending,
        first_token_s=t.first_token_s, stall_s=t.loop_stall_s,
    )  # fmt: skip
    return loop, tracer


def prefill_loop(node: NodeConfig, on_done: DoneHook | None = None, on_report: ReportHook | None = None) -> PrefillLoop:
    if node.mpi_rank is None:
        engine = LLMEngine(node.engine, load_tokenizer=False)
        transport = NixlTransport(node.agent_name, node.transport.backend)
        stall_s = node.timeouts.loop_stall_s
        return PrefillLoop.standalone(engine, transport, on_done=on_done, on_report=on_report, stall_s=stall_s)
    rank = bootstrap(node)
    assert rank.channel is not None
    side, tracer = rank.prefill_side(), _tracer(node)
    if tracer is not None:
        rank.engine.attach(TraceObserver(tracer))
    return PrefillLoop(
        rank.engine,
        side,
        on_done=on_done,
        on_exit=rank.channel.stop,
        tracer=tracer,
        on_report=on_report,
        membership=rank.membership(Role.DECODE),
        stall_s=node.timeouts.loop_stall_s,
    )


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

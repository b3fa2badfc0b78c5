"""One MPI rank of a deployment coming up: TP rendezvous, engine, messenger side, peer exchange.

Every rank (a group leader inside its Triton stub, or a follower worker) calls ``bootstrap``:

1. ``allgather`` #1 over ``MPI.COMM_WORLD``: who is where; each TP leader announces a free port
   on its host, and its group joins ``torch.distributed`` (gloo) there.
2. The engine (this rank's shard) and this rank's messenger side with its own NIXL agent.
3. ``allgather`` #2: every rank's ``RankEndpoint`` (NIXL agent metadata, KV pool addresses) and
   every leader's Triton gRPC endpoint. Prefill ranks connect to every decode rank and decode
   ranks to every prefill rank, so any decode group can use any prefill group.

MPI is used for these two exchanges only; nothing else rides on it.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from kv_messenger.decode_side import DecodeSide
from kv_messenger.layout import PROTOCOL_VERSION
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.protocol import RankEndpoint
from kv_messenger.transport.base import FaultInjector
from kv_messenger.transport.nixl import NixlTransport
from serving.kv_links import engine_layout, metadata_bytes
from serving.node_config import NodeConfig
from serving.ports import free_port
from serving.prefill_client import PrefillGroup
from serving.tp_group import GroupChannel, GroupDecodeSide, GroupPrefillSide
from torch_engine.config import Role
from torch_engine.engine import LLMEngine
from torch_engine.parallel import TPGroup

log = logging.getLogger(__name__)


class Announcement(BaseModel):
    """What one rank tells every other at start-up (over MPI allgather)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = PROTOCOL_VERSION
    mpi_rank: int
    role: Role
    group: int
    tp_rank: int
    host: str
    tp_port: int = 0  # TP leaders with TP > 1: the torch.distributed rendezvous port
    grpc_url: str | None = None
    endpoint: RankEndpoint | None = None


@dataclass(slots=True)
class Rank:
    node: NodeConfig
    engine: LLMEngine
    channel: GroupChannel | None  # leaders
    local_side: PrefillSide | DecodeSide | None
    peers: list[Announcement]

    def prefill_groups(self) -> list[PrefillGroup]:
        groups: dict[int, list[Announcement]] = {}
        for a in self.peers:
            if a.role is Role.PREFILL:
                groups.setdefault(a.group, []).append(a)
        out = []
        for g, members in sorted(groups.items()):
            members.sort(key=lambda a: a.tp_rank)
            leader = members[0]
            assert leader.grpc_url is not None and all(m.endpoint is not None for m in members)
            out.append(PrefillGroup(g, leader.grpc_url, [m.endpoint.agent for m in members if m.endpoint]))
        return out

    def group_agents(self) -> list[str]:
        mine = [a for a in self.peers if a.role is self.node.role and a.group == self.node.group]
        return [a.endpoint.agent for a in sorted(mine, key=lambda a: a.tp_rank) if a.endpoint is not None]

    def prefill_side(self) -> GroupPrefillSide:
        assert isinstance(self.local_side, PrefillSide) and self.channel is not None
        return GroupPrefillSide(self.local_side, self.channel)

    def decode_side(self) -> GroupDecodeSide:
        assert isinstance(self.local_side, DecodeSide) and self.channel is not None
        return GroupDecodeSide(self.local_side, self.channel, self.group_agents())


def bootstrap(node: NodeConfig) -> Rank:
    from mpi4py import MPI  # only ranks of an mpirun deployment get here

    comm = MPI.COMM_WORLD
    if node.mpi_rank is not None and comm.Get_rank() != node.mpi_rank:
        raise RuntimeError(
            f"this process is MPI rank {comm.Get_rank()}, but its node config is for rank {node.mpi_rank}: "
            "the mpirun command and the rendered configs disagree"
        )
    leader = node.tp_rank == 0
    port = free_port(node.host) if leader and node.tp_size > 1 else 0
    me = Announcement(
        mpi_rank=comm.Get_rank(), role=node.role, group=node.group, tp_rank=node.tp_rank, host=node.host, tp_port=port
    )
    first = [Announcement.model_validate_json(s) for s in comm.allgather(me.model_dump_json())]
    engine = LLMEngine(node.engine, tp=_tp_group(node, first), load_tokenizer=leader and node.role is not Role.PREFILL)
    side = _messenger_side(node, engine)
    endpoint = side.endpoint() if side is not None else None
    me = me.model_copy(update={"grpc_url": node.grpc_url if leader else None, "endpoint": endpoint})
    peers = [Announcement.model_validate_json(s) for s in comm.allgather(me.model_dump_json())]
    for a in peers:
        if a.version != PROTOCOL_VERSION:
            raise RuntimeError(f"MPI rank {a.mpi_rank} speaks protocol {a.version}, this rank {PROTOCOL_VERSION}")
    if isinstance(side, PrefillSide):
        side.connect([a.endpoint for a in peers if a.role is Role.DECODE and a.endpoint is not None])
    elif isinstance(side, DecodeSide):
        side.connect([a.endpoint for a in peers if a.role is Role.PREFILL and a.endpoint is not None])
    log.info("rank %d (%s group %d tp %d) up", comm.Get_rank(), node.role.value, node.group, node.tp_rank)
    channel = GroupChannel(engine, on_steps=side is not None) if leader else None
    return Rank(node, engine, channel, side, peers)


def _tp_group(node: NodeConfig, first: list[Announcement]) -> TPGroup:
    """Join this rank's TP group over gloo at its leader's announced port (TP 1: no collective)."""
    if node.tp_size == 1:
        return TPGroup.single()
    import torch.distributed as dist

    lead = next(a for a in first if a.role is node.role and a.group == node.group and a.tp_rank == 0)
    cuda = node.engine.device.startswith("cuda")
    if cuda:  # the rank's one visible GPU: NCCL's collectives and the step broadcasts live there
        import torch

        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{lead.host}:{lead.tp_port}",
        rank=node.tp_rank,
        world_size=node.tp_size,
        timeout=datetime.timedelta(seconds=node.timeouts.tp_collective_s),  # idle groups heartbeat every second
    )
    return TPGroup(node.tp_rank, node.tp_size)


def _messenger_side(node: NodeConfig, engine: LLMEngine) -> PrefillSide | DecodeSide | None:
    """This rank's messenger side with its own NIXL agent. A decode rank whose engine drafts with MTP
    gets metadata slots (the prefill's last hidden state, one slot per request in transfer, two
    batches' worth; a request that finds none starts without its first draft)."""
    if node.role is Role.COLOCATED:
        return None
    faults = FaultInjector(fail_rate=node.transport.fault_write_fail_rate, seed=node.mpi_rank or 0)
    transport = NixlTransport(node.agent_name, node.transport.backend, faults=faults)
    t = node.timeouts
    if node.role is Role.PREFILL:
        return PrefillSide(
            transport,
            engine_layout(engine),
            engine.kv.pools,
            engine.progress,
            metadata_bytes(engine),
            layers_per_post=node.transport.layers_per_post,
            tombstone_s=t.prefill_tombstone_s,
        )
    slots = 2 * engine.config.scheduler.max_num_seqs if engine.wants_prefill_hidden else 0
    meta = metadata_bytes(engine) if slots else 0
    return DecodeSide(transport, engine_layout(engine), engine.kv.pools, meta, slots, grace_s=t.fence_grace_s)

"""One MPI rank of a deployment coming up: TP rendezvous, engine, messenger side, membership.

Each group is its own ``mpirun`` job (``MPI.COMM_WORLD`` is the group); every rank (a group leader
inside its Triton stub, or a follower worker) calls ``bootstrap``:

1. ``allgather`` #1 over the group: who is where; a TP leader announces a free port on its host,
   and its group joins ``torch.distributed`` (gloo / NCCL) there.
2. The engine (this rank's shard) and this rank's messenger side with its own NIXL agent.
3. ``allgather`` #2 over the group: every rank's ``RankEndpoint`` (NIXL agent metadata, KV pool
   addresses) and the leader's Triton gRPC endpoint; the leader publishes the group's record in
   the deployment's registry (``serving/registry.py``).
4. Every rank waits for the records of the groups it must reach (``NodeConfig.peer_groups``):
   prefill ranks connect to every decode rank and decode ranks to every prefill rank, so any
   decode group can use any prefill group. Later arrivals (a restarted group) are connected by the
   running leaders (``Membership``).

MPI is used for these two group-local exchanges only; nothing else rides on it.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from serving.registry import GroupKey, GroupRecord, Member, Membership, Registry
from serving.tp_group import GroupChannel, GroupDecodeSide, GroupPrefillSide
from torch_engine.config import Role

if TYPE_CHECKING:
    from torch.distributed import Store
from torch_engine.connector import ConnectorPort
from torch_engine.engine import LLMEngine
from torch_engine.parallel import TPGroup

log = logging.getLogger(__name__)


class Announcement(BaseModel):
    """What one rank tells the others of its group at start-up (over MPI allgather)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = PROTOCOL_VERSION
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
    groups: dict[GroupKey, GroupRecord]  # every group up at start-up, this one included
    registry: Registry

    def prefill_groups(self) -> list[PrefillGroup]:
        found = [r for k, r in self.groups.items() if k[0] is Role.PREFILL]
        return [PrefillGroup.of(r) for r in sorted(found, key=lambda r: r.group)]

    def group_agents(self) -> list[str]:
        return self.groups[(self.node.role, self.node.group)].agents

    def membership(self, role: Role) -> Membership:
        """The running view of ``role``'s groups, starting from those up at start-up."""
        return Membership(self.registry, role, self.groups.values())

    def prefill_side(self) -> GroupPrefillSide:
        assert isinstance(self.local_side, PrefillSide) and self.channel is not None
        return GroupPrefillSide(self.local_side, self.channel)

    def decode_side(self) -> GroupDecodeSide:
        assert isinstance(self.local_side, DecodeSide) and self.channel is not None
        return GroupDecodeSide(self.local_side, self.channel, self.group_agents())


def bootstrap(node: NodeConfig) -> Rank:
    from mpi4py import MPI  # only ranks of an mpirun deployment get here

    comm = MPI.COMM_WORLD
    if comm.Get_size() != node.tp_size or comm.Get_rank() != node.tp_rank:
        raise RuntimeError(
            f"this process is rank {comm.Get_rank()} of {comm.Get_size()} in its mpirun job, but its node config "
            f"is for TP rank {node.tp_rank} of {node.tp_size}: the mpirun command and the rendered configs disagree"
        )
    if node.registry is None:
        raise RuntimeError("a deployment's node config names its registry (the launcher renders it)")
    registry = Registry(node.registry)
    leader = node.tp_rank == 0
    port = free_port(node.host) if leader and node.tp_size > 1 else 0
    me = Announcement(role=node.role, group=node.group, tp_rank=node.tp_rank, host=node.host, tp_port=port)
    first = [Announcement.model_validate_json(s) for s in comm.allgather(me.model_dump_json())]
    engine = LLMEngine(node.engine, tp=_tp_group(node, first), load_tokenizer=leader and node.role is not Role.PREFILL)
    side = _messenger_side(node, engine)
    endpoint = side.endpoint() if side is not None else None
    me = me.model_copy(update={"grpc_url": node.grpc_url if leader else None, "endpoint": endpoint})
    mine = [Announcement.model_validate_json(s) for s in comm.allgather(me.model_dump_json())]
    members = [Member(tp_rank=a.tp_rank, host=a.host, grpc_url=a.grpc_url, endpoint=a.endpoint) for a in mine]
    own = GroupRecord(role=node.role, group=node.group, generation=node.generation, members=members)
    if leader:
        registry.publish(own)
    groups = registry.wait(node.peer_groups, node.startup_s) if node.peer_groups else {}
    groups[own.key] = own
    if isinstance(side, PrefillSide):
        side.connect([ep for k, r in groups.items() if k[0] is Role.DECODE for ep in r.endpoints])
    elif isinstance(side, DecodeSide):
        side.connect([ep for k, r in groups.items() if k[0] is Role.PREFILL for ep in r.endpoints])
    log.info("%s group %d tp %d (generation %d) up", node.role.value, node.group, node.tp_rank, node.generation)
    channel = GroupChannel(engine, on_steps=side is not None) if leader else None
    return Rank(node, engine, channel, side, groups, registry)


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
    timeout = datetime.timedelta(seconds=node.timeouts.tp_collective_s)  # idle groups heartbeat every second
    store = _rendezvous(lead.host, lead.tp_port, node.tp_rank, node.tp_size, timeout)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=node.tp_rank, world_size=node.tp_size, timeout=timeout
    )
    return TPGroup(node.tp_rank, node.tp_size)


_LISTENERS: list[socket.socket] = []  # the rendezvous servers' sockets: open as long as the process


def _rendezvous(host: str, port: int, rank: int, size: int, timeout: datetime.timedelta) -> Store:
    """The TP group's TCPStore at its leader's ``host:port``. The leader's server listens on a socket
    bound to ``host`` (torch's own binds every interface, ``::``), handed over as ``master_listen_fd``."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(size * 4)
    _LISTENERS.append(sock)
    return dist.TCPStore(host, port, size, True, timeout, master_listen_fd=sock.fileno())


def _messenger_side(node: NodeConfig, engine: ConnectorPort) -> PrefillSide | DecodeSide | None:
    """This rank's messenger side with its own NIXL agent. A decode rank whose engine drafts with MTP
    gets metadata slots (the prefill's last hidden state, one slot per request in transfer, two
    batches' worth; a request that finds none starts without its first draft)."""
    if node.role is Role.COLOCATED:
        return None
    faults = FaultInjector(fail_rate=node.transport.fault_write_fail_rate, seed=node.mpi_rank or 0)
    transport = NixlTransport(node.agent_name, node.transport.backend, faults=faults)
    t, kv = node.timeouts, engine.kv_export()
    if node.role is Role.PREFILL:
        return PrefillSide(
            transport,
            engine_layout(kv),
            kv.pools,
            kv.progress,
            metadata_bytes(kv),
            layers_per_post=node.transport.layers_per_post,
            tombstone_s=t.prefill_tombstone_s,
        )
    slots = 2 * node.engine.scheduler.max_num_seqs if engine.wants_prefill_hidden else 0
    meta = metadata_bytes(kv) if slots else 0
    return DecodeSide(transport, engine_layout(kv), kv.pools, meta, slots, grace_s=t.fence_grace)

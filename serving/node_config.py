"""What one serving node runs: loaded once from a JSON / YAML file and passed down.

``NodeConfig`` embeds the engine's own config and the messenger's transport spec instead of
copying their fields; the launcher renders one per rank from the cluster config. The Triton
backend finds it through the one environment variable it reads, ``NODE_CONFIG_ENV``.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kv_messenger.config import TransportSpec
from planner.placement import PlacementSpec
from torch_engine.config import EngineConfig, Role

NODE_CONFIG_ENV = "DISAGG_NODE_CONFIG"  # the node config file of a serving process
AUTH_HEADER = "x-disagg-key"  # the header restricted Triton protocols check (lower case: gRPC metadata)
GRPC_AUTH_HEADER = f"triton-grpc-protocol-{AUTH_HEADER}"  # what Triton expects of gRPC callers for it


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RequestLimits(_Frozen):
    max_tokens: int = Field(default=4096, ge=1, description="the largest max_tokens a request may ask for")
    max_pending: int = Field(
        default=256,
        ge=1,
        description="requests a decode / colocated node holds before their first token (queued, waiting for pages "
        "or KV); one more is refused at once as overloaded (routers answer 503 + Retry-After or try another group)",
    )


FENCE_MARGIN_S = 5.0  # a fence outlasts the prefill job's deadline by at least this


class RequestTimeouts(_Frozen):
    """Every wait on the request path, declared once (the cluster config's ``timeouts:``)."""

    kv_transfer_s: float = Field(
        default=60.0, gt=0, description="reserve -> all KV landed; also the prefill job's deadline from its arrival"
    )
    prefill_request_s: float = Field(default=10.0, gt=0, description="one prefill request call")
    fence_grace_s: float | None = Field(
        default=None,
        gt=0,
        description="pages of a failed / abandoned transfer come back this long after it ended if a sender never "
        f"confirmed it stopped (a dead prefill node); at least kv_transfer_s + {FENCE_MARGIN_S:.0f} s (a prefill job "
        "may write until its deadline, kv_transfer_s after it arrived); None: exactly that",
    )
    prefill_tombstone_s: float = Field(
        default=600.0, gt=0, description="a prefill node refuses an epoch the decoder aborted before it arrived"
    )
    tp_collective_s: float = Field(
        default=300.0,
        ge=5,
        description="one TP-group broadcast / gather (idle groups heartbeat every second): a stuck rank fails the "
        "group instead of wedging it",
    )
    first_token_s: float = Field(
        default=300.0,
        gt=0,
        description="a request still without its first token this long after it reached a decode / colocated node "
        "is aborted as overloaded (bounded queueing); more than kv_transfer_s",
    )
    head_of_line_s: float = Field(
        default=5.0,
        ge=0,
        description="a decode node's request waiting for pages to reserve is passed by later ones that fit for at "
        "most this long; then nothing passes it until it has its pages (0: strict arrival order)",
    )
    loop_stall_s: float = Field(
        default=360.0,
        gt=0,
        description="a serving loop that has not finished a pass for this long is wedged: the process exits and its "
        "group is restarted; more than tp_collective_s (a stuck TP peer fails the group first)",
    )

    @model_validator(mode="after")
    def _fence_outlasts_the_job(self) -> RequestTimeouts:
        if self.fence_grace_s is not None and self.fence_grace_s < self.kv_transfer_s + FENCE_MARGIN_S:
            raise ValueError(
                f"timeouts.fence_grace_s ({self.fence_grace_s} s) must be at least timeouts.kv_transfer_s "
                f"({self.kv_transfer_s} s) + {FENCE_MARGIN_S:.0f} s: a prefill job may still write until its deadline, "
                "so a shorter grace could hand out pages a late write then lands in"
            )
        if self.first_token_s <= self.kv_transfer_s:
            raise ValueError(
                f"timeouts.first_token_s ({self.first_token_s} s) must be more than timeouts.kv_transfer_s "
                f"({self.kv_transfer_s} s): a request whose KV is on the way would be aborted before its transfer "
                "could fail over"
            )
        if self.loop_stall_s <= self.tp_collective_s:
            raise ValueError(
                f"timeouts.loop_stall_s ({self.loop_stall_s} s) must be more than timeouts.tp_collective_s "
                f"({self.tp_collective_s} s): a step waiting on a stuck TP peer fails the group by that deadline"
            )
        return self

    @property
    def fence_grace(self) -> float:
        """The grace in effect (``fence_grace_s``, or ``kv_transfer_s`` + the margin)."""
        return self.fence_grace_s if self.fence_grace_s is not None else self.kv_transfer_s + FENCE_MARGIN_S


def group_name(role: Role, group: int) -> str:
    """A group's one name, everywhere (launcher scripts and logs, the router's groups, traces, request
    ids): ``prefill0``, ``decode1``; a colocated group takes requests as a decode group does: ``decode0``."""
    return f"{'prefill' if role is Role.PREFILL else 'decode'}{group}"


class NodeConfig(_Frozen):
    """One process (MPI rank) of a deployment. Without ``mpi_rank`` it is a standalone node (tests,
    single-server use)."""

    engine: EngineConfig
    transport: TransportSpec = TransportSpec()
    placement: PlacementSpec = PlacementSpec()  # decode nodes of a disaggregated deployment: where prompts prefill
    limits: RequestLimits = RequestLimits()
    timeouts: RequestTimeouts = RequestTimeouts()
    agent_name: str = "disagg-node"  # NIXL agent name of this node's messenger
    role: Role = Role.COLOCATED  # DECODE: KV comes from prefill groups; PREFILL; COLOCATED: prefills itself
    group: int = Field(default=0, ge=0)
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    mpi_rank: int | None = Field(default=None, ge=0)  # set: this rank is part of an mpirun deployment
    host: str = "127.0.0.1"  # where this rank's servers (TP rendezvous, Triton) listen
    grpc_url: str | None = None  # group leaders: their Triton gRPC endpoint, announced to the peers
    trace_path: Path | None = None  # JSONL of per-request server-side timestamps (benchmarks)
    auth_key: str | None = None  # the deployment's secret: sent (AUTH_HEADER) on calls to restricted protocols
    # deployments: the membership registry (``serving/registry.py``), this group's restart count (its
    # agents' names carry it), the groups this rank waits for at start-up, and how long it waits
    registry: Path | None = None
    generation: int = Field(default=0, ge=0)
    peer_groups: list[tuple[Role, int]] = Field(default_factory=list)
    startup_s: float = Field(default=300.0, gt=0)

    @classmethod
    def load(cls, path: str | Path) -> NodeConfig:
        text = Path(path).read_text(encoding="utf-8")
        return cls.model_validate(yaml.safe_load(text))

    def dump(self, path: Path) -> None:
        """Owner-only (0600, from its creation on): it may carry the deployment's key."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(self.model_dump(mode="json")))

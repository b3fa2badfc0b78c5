"""What one serving node runs: loaded once from a JSON / YAML file and passed down."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from torch_engine.config import EngineConfig, Role


class NodeConfig(BaseModel):
    """One process (MPI rank) of a deployment; the launcher renders one per rank from the cluster
    config. Without ``mpi_rank`` it is a standalone node (tests, single-server use)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_dir: Path
    device: str = "cpu"
    num_pages: int = Field(default=1024, ge=1)
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_prefill_chunk: int = Field(default=512, ge=1)
    num_threads: int | None = Field(default=None, ge=1)
    max_tokens_limit: int = Field(default=4096, ge=1)  # the largest max_tokens a request may ask for
    agent_name: str = "disagg-node"  # NIXL agent name of this node's messenger (prefill role)
    nixl_backend: str = "UCX"
    layers_per_post: int = Field(default=1, ge=1)  # prefill: post KV every this many finished layers
    role: Role = Role.COLOCATED  # DECODE: KV comes from prefill groups; PREFILL; COLOCATED: prefills itself
    group: int = Field(default=0, ge=0)
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    mpi_rank: int | None = Field(default=None, ge=0)  # set: this rank is part of an mpirun deployment
    host: str = "127.0.0.1"  # where this rank's servers (TP rendezvous, Triton) listen
    grpc_url: str | None = None  # group leaders: their Triton gRPC endpoint, announced to the peers
    kv_timeout_s: float = Field(default=60.0, gt=0)
    prefill_request_timeout_s: float = Field(default=10.0, gt=0)
    trace_path: Path | None = None  # JSONL of per-request server-side timestamps (benchmarks)

    @classmethod
    def load(cls, path: str | Path) -> NodeConfig:
        text = Path(path).read_text(encoding="utf-8")
        return cls.model_validate(yaml.safe_load(text))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            engine_dir=self.engine_dir,
            device=self.device,
            num_pages=self.num_pages,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_chunk=self.max_prefill_chunk,
            num_threads=self.num_threads,
        )

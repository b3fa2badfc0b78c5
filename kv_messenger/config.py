"""The messenger's settings, declared once: which NIXL backend moves bytes, how often prefill ranks post."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field


class NixlBackend(enum.StrEnum):
    UCX = "UCX"  # RDMA, shared memory or TCP, whatever UCX finds
    LIBFABRIC = "LIBFABRIC"  # EFA


class TransportSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: NixlBackend = Field(default=NixlBackend.UCX, description="NIXL backend")
    layers_per_post: int = Field(
        default=4,
        ge=1,
        description="prefill ranks post KV once this many layers finished (1: every layer); 4 by measurement "
        "(ARCHITECTURE.md, 'When the prefill posts')",
    )
    fault_write_fail_rate: float = Field(
        default=0.0, ge=0, le=1, description="testing only: this share of KV writes fail at random (seeded per rank)"
    )

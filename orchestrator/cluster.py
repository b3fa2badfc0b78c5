"""The cluster spec: one YAML file describes a whole deployment; loaded once, frozen, validated.

``ClusterConfig.load(path)`` rejects unknown keys and impossible combinations with a message
that names the field. ``rank_map()`` lays the deployment out as MPI ranks (MPMD order: decode
groups first, then prefill groups; inside a group, TP rank 0 is the leader that runs
``tritonserver``). In ``colocated`` mode there are no prefill groups: every decode group
prefills its own requests (the benchmark's baseline), behind the same launcher.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from builders.build import DEFAULT_ENGINE_CACHE
from frontend.config import RouterSpec
from kv_messenger.config import TransportSpec
from serving.node_config import RequestLimits, RequestTimeouts
from torch_engine.config import DType, KVLayout, Role, SchedulerConfig, SpeculativeConfig


class ConfigError(ValueError):
    pass


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Mode(enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class GroupSpec(_Frozen):
    count: int = Field(default=1, ge=0, description="number of groups of this role")
    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks per group")
    engine_dir: Path | None = Field(default=None, description="a built engine; None: build from `model`")
    num_pages: int | None = Field(default=None, ge=1, description="KV pages per rank; None: the engine's default")
    cores: list[int] | None = Field(default=None, description="CPU cores to pin each rank to (taskset), in rank order")


class Restrict(enum.Enum):
    AUTO = "auto"  # on when the deployment binds anything but loopback
    ON = "on"
    OFF = "off"


class SecuritySpec(_Frozen):
    restrict: Restrict = Field(
        default=Restrict.AUTO,
        description="Triton's model-repository protocol (every node) and inference protocol (prefill nodes) "
        "need the deployment's secret key; auto: on unless bound to loopback",
    )


class PortSpec(_Frozen):
    http: int = Field(default=8000, ge=1, le=65535)
    grpc: int = Field(default=8001, ge=1, le=65535)
    metrics: int = Field(default=8002, ge=1, le=65535)
    internal_base: int | None = Field(
        default=None, ge=1024, le=65000, description="ports of the other group leaders: base + 3 * i; None: free ports"
    )


class TimeoutSpec(RequestTimeouts):
    """The nodes' request timeouts, and the launcher's own."""

    startup_s: float = Field(default=300.0, gt=0, description="launch -> every leader ready")
    shutdown_s: float = Field(default=20.0, gt=0, description="Ctrl-C / a dead rank -> everything gone")


class ClusterConfig(_Frozen):
    model: str = Field(default="smollm2", description="checkpoint: 'smollm2' (embedded), a .gguf or an HF folder")
    dtype: DType = Field(default=DType.FLOAT32, description="dtype the engines are built (stored) in")
    run_dtype: DType | Literal["auto"] = Field(
        default="auto", description="dtype the engines compute in; auto: bf16 where the CPU has it natively, else fp32"
    )
    mode: Mode = Mode.DISAGGREGATED
    prefill: GroupSpec = GroupSpec()
    decode: GroupSpec = GroupSpec()
    page_size: int = Field(default=16, ge=1)
    kv_layout: KVLayout = KVLayout.HND
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()  # decode / colocated groups (prefill nodes never sample)
    limits: RequestLimits = RequestLimits()
    timeouts: TimeoutSpec = TimeoutSpec()
    transport: TransportSpec = TransportSpec()
    ports: PortSpec = PortSpec()
    router: RouterSpec = RouterSpec()
    security: SecuritySpec = SecuritySpec()
    bind: str = Field(default="127.0.0.1", description="address every server binds to")
    threads_per_rank: int = Field(default=1, ge=1, description="torch threads of each rank")
    hosts: list[str] = Field(default_factory=list, description="hostfile lines (e.g. 'node1 slots=4'); empty: local")
    engine_cache: Path = Field(default=DEFAULT_ENGINE_CACHE)
    run_dir: Path = Field(default=Path("runs/deploy"), description="logs, rendered configs and the mpirun script")

    @property
    def restricted(self) -> bool:
        """Do restricted protocols need the deployment's key (``security.restrict``)?"""
        if self.security.restrict is Restrict.AUTO:
            return not self.bind.startswith("127.") and self.bind not in ("localhost", "::1")
        return self.security.restrict is Restrict.ON

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.decode.count < 1:
            raise ValueError("decode.count must be >= 1: requests enter at a decode group")
        if self.mode is Mode.DISAGGREGATED and self.prefill.count < 1:
            raise ValueError("mode 'disaggregated' needs prefill.count >= 1")
        if self.mode is Mode.COLOCATED and self.prefill.count > 0:
            raise ValueError("mode 'colocated' has no prefill groups: set prefill.count to 0 (decode groups prefill)")
        for role, spec in (("prefill", self.prefill), ("decode", self.decode)):
            if spec.cores is not None and len(spec.cores) != spec.count * spec.tp:
                raise ValueError(f"{role}.cores lists {len(spec.cores)} cores for {spec.count * spec.tp} ranks")
        ports = [self.ports.http, self.ports.grpc, self.ports.metrics]
        if len(set(ports)) != 3:
            raise ValueError(f"ports must differ, got http/grpc/metrics {ports}")
        if self.router.enabled and self.router.port in ports:
            raise ValueError(f"router.port {self.router.port} is also one of the Triton ports {ports}")
        if self.scheduler.max_prefill_chunk > self.scheduler.max_num_batched_tokens:
            raise ValueError("scheduler.max_prefill_chunk must not exceed scheduler.max_num_batched_tokens")
        return self

    @classmethod
    def load(cls, path: str | Path) -> ClusterConfig:
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"cluster config {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        return cls.parse(raw or {}, str(path))

    @classmethod
    def parse(cls, raw: object, source: str = "cluster config") -> ClusterConfig:
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"{source}: {problems}") from None

    def spec(self, role: Role) -> GroupSpec:
        return self.prefill if role is Role.PREFILL else self.decode

    def serving_role(self) -> Role:
        """What decode groups do: DECODE (KV from prefill groups) or COLOCATED (prefill themselves)."""
        return Role.DECODE if self.mode is Mode.DISAGGREGATED else Role.COLOCATED

    def rank_map(self) -> list[RankSlot]:
        """Every MPI rank of the deployment, in MPMD order."""
        slots: list[RankSlot] = []
        groups = [(self.serving_role(), self.decode), (Role.PREFILL, self.prefill)]
        for role, spec in groups:
            if role is Role.PREFILL and self.mode is Mode.COLOCATED:
                continue
            for g in range(spec.count):
                for r in range(spec.tp):
                    core = spec.cores[g * spec.tp + r] if spec.cores is not None else None
                    slots.append(RankSlot(len(slots), role, g, r, spec.tp, core))
        return slots


@dataclass(frozen=True, slots=True)
class RankSlot:
    mpi_rank: int
    role: Role  # DECODE / COLOCATED (requests enter here) or PREFILL
    group: int
    tp_rank: int
    tp_size: int
    core: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def name(self) -> str:
        kind = "prefill" if self.role is Role.PREFILL else "decode"
        return f"{kind}{self.group}.tp{self.tp_rank}"

    def describe(self) -> str:
        kind = "prefill" if self.role is Role.PREFILL else ("decode" if self.role is Role.DECODE else "colocated")
        return f"{kind} group {self.group} TP rank {self.tp_rank} (MPI rank {self.mpi_rank})"

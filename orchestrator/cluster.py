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
from functools import cached_property
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from builders.build import DEFAULT_ENGINE_CACHE
from frontend.config import RouterSpec
from kv_messenger.config import TransportSpec
from planner.placement import PlacementSpec
from serving.node_config import RequestLimits, RequestTimeouts, group_name
from torch_engine.config import (
    DType,
    KVLayout,
    PrefixCacheConfig,
    Role,
    SchedulerConfig,
    SpeculativeConfig,
    WeightStorage,
)


class ConfigError(ValueError):
    pass


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Mode(enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class Device(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"  # one GPU per rank (CUDA_VISIBLE_DEVICES), NCCL inside TP groups


class HostSpec(_Frozen):
    """A machine of the deployment."""

    name: str = Field(min_length=1, description="the host's name as mpirun reaches it (hostfile, ssh)")
    address: str = Field(min_length=1, description="the address its servers bind to and advertise to the others")
    slots: int | None = Field(default=None, ge=1, description="ranks it may run; None: no limit")
    cores: list[int] | None = Field(default=None, description="CPU cores its ranks are pinned to, in placement order")
    gpus: list[int] = Field(default_factory=list, description="GPU ids it offers (CUDA_VISIBLE_DEVICES values)")
    workdir: Path | None = Field(default=None, description="the ranks' working directory there; None: mpirun's")


class NetworkSpec(_Frozen):
    """How ranks on several hosts reach each other (mpirun's launch and wire-up, UCX)."""

    interface: str | None = Field(
        default=None, description="the one interface MPI's out-of-band / TCP traffic and UCX use (e.g. eth0)"
    )
    launch_agent: str | None = Field(
        default=None, description="what starts mpirun's daemons on other hosts, called like ssh (HOST COMMAND...)"
    )
    ucx_transports: str | None = Field(
        default=None, description="UCX_TLS of the ranks, e.g. 'tcp,self' where hosts share a kernel (emulated hosts)"
    )


class GroupSpec(_Frozen):
    count: int = Field(default=1, ge=0, description="number of groups of this role")
    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks per group")
    engine_dir: Path | None = Field(default=None, description="a built engine; None: build from `model`")
    num_pages: int | None = Field(default=None, ge=1, description="KV pages per rank; None: the engine's default")
    cores: list[int] | None = Field(default=None, description="CPU cores to pin each rank to (taskset), in rank order")
    device: Device = Field(default=Device.CPU, description="where its engines run: cpu, or cuda (one GPU per rank)")
    hosts: list[str] | None = Field(
        default=None,
        description="the host of each group, by name, in group order; None: packed onto the hosts in order",
    )


class Restrict(enum.Enum):
    AUTO = "auto"  # on when the deployment binds anything but loopback
    ON = "on"
    OFF = "off"


class SecuritySpec(_Frozen):
    restrict: Restrict = Field(
        default=Restrict.AUTO,
        description="Triton's model-repository protocol (every node) and inference protocol (prefill nodes) "
        "need the deployment's secret key, and a router bound off loopback needs router.api_key; auto: on unless "
        "bound to loopback",
    )


class PortSpec(_Frozen):
    http: int = Field(default=8000, ge=1, le=65535)
    grpc: int = Field(default=8001, ge=1, le=65535)
    metrics: int = Field(default=8002, ge=1, le=65535)
    internal_base: int | None = Field(
        default=None, ge=1024, le=65000, description="ports of the other group leaders: base + 3 * i; None: free ports"
    )


class RestartSpec(_Frozen):
    """A group whose rank died is restarted as a whole (its own mpirun job), after a back-off that
    doubles with each restart of that group, at most ``max_restarts`` times."""

    max_restarts: int = Field(default=3, ge=0, description="restarts of one group; then it stays down")
    backoff_s: float = Field(default=1.0, ge=0, description="wait before the first restart of a group")
    max_backoff_s: float = Field(default=30.0, ge=0, description="the longest wait between restarts")


class TimeoutSpec(RequestTimeouts):
    """The nodes' request timeouts, and the launcher's own."""

    startup_s: float = Field(default=300.0, gt=0, description="launch -> every leader ready")
    shutdown_s: float = Field(default=20.0, gt=0, description="Ctrl-C / a dead rank -> everything gone")


class ClusterConfig(_Frozen):
    model: str = Field(default="smollm2", description="checkpoint: 'smollm2' (embedded), a .gguf or an HF folder")
    mtp_head: Path | None = Field(
        default=None, description="an MTP head attached to `model` at build time (disagg train-mtp)"
    )
    dtype: DType = Field(default=DType.FLOAT32, description="dtype the engines are built (stored) in")
    weights: WeightStorage = Field(
        default=WeightStorage.AS_STORED,
        description="as-stored: a GGUF's Q8_0 / Q6_K / Q5_K / Q5_1 / Q5_0 / Q4_K / Q4_1 / Q4_0 / IQ4_NL / Q3_K / Q2_K "
        "tensors stay "
        "quantized (the CPU engines compute with them); dense: every weight dequantised to `dtype`",
    )
    quantize: (
        Literal["q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_nl", "q3_k", "q2_k"] | None
    ) = Field(
        default=None,
        description="Q8_0 / Q6_K / Q5_K / Q5_1 / Q5_0 / Q4_K / Q4_1 / Q4_0 / IQ4_NL / Q3_K / Q2_K: the dense GEMM "
        "weights left (an HF checkpoint's, a GGUF's F16) quantized to that block format at build time (embedding and "
        "lm_head Q8_0)",
    )
    restart: RestartSpec = RestartSpec()
    run_dtype: DType | Literal["auto"] = Field(
        default="auto", description="dtype the engines compute in; auto: bf16 where the CPU has it natively, else fp32"
    )
    kv_dtype: DType | None = Field(
        default=None,
        description="dtype of the engines' KV pages (prefill and decode alike); None: their compute dtype, except "
        "bfloat16 under run_dtype auto on a CPU that computes in fp32: half the KV's bytes (on the wire too)",
    )
    mode: Mode = Mode.DISAGGREGATED
    prefill: GroupSpec = GroupSpec()
    decode: GroupSpec = GroupSpec()
    page_size: int = Field(default=16, ge=1)
    kv_layout: KVLayout = KVLayout.HND
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()  # decode / colocated groups (prefill nodes never sample)
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()  # every group: reuse full KV pages of repeated prefixes
    limits: RequestLimits = RequestLimits()
    timeouts: TimeoutSpec = TimeoutSpec()
    transport: TransportSpec = TransportSpec()
    placement: PlacementSpec = PlacementSpec()  # disaggregated decode groups: prefill a request here or remotely
    ports: PortSpec = PortSpec()
    router: RouterSpec = RouterSpec()
    security: SecuritySpec = SecuritySpec()
    bind: str = Field(default="127.0.0.1", description="address every server binds to")
    threads_per_rank: int = Field(default=1, ge=1, description="torch threads of each rank")
    hosts: list[HostSpec] = Field(default_factory=list, description="the machines; empty: this one")
    tp_across_hosts: bool = Field(default=False, description="may a TP group's ranks be spread over hosts")
    network: NetworkSpec = NetworkSpec()
    engine_cache: Path = Field(default=DEFAULT_ENGINE_CACHE)
    run_dir: Path = Field(default=Path("runs/deploy"), description="logs, rendered configs and the mpirun script")

    @property
    def loopback(self) -> bool:
        """Do the servers bound to ``bind`` (the router among them) listen on loopback only?"""
        return self.bind.startswith("127.") or self.bind in ("localhost", "::1")

    @property
    def restricted(self) -> bool:
        """Do restricted protocols need the deployment's key (``security.restrict``)?"""
        if self.security.restrict is Restrict.AUTO:  # anything reachable from another machine
            return self.multi_host or not self.loopback
        return self.security.restrict is Restrict.ON

    @field_validator("hosts", mode="before")
    @classmethod
    def _host_entries(cls, value: object) -> object:
        if isinstance(value, list) and any(isinstance(h, str) for h in value):
            raise ValueError(
                "each entry is {name, address, slots, cores, gpus, workdir}: a hostfile line like "
                "'node1 slots=2' does not say which address the host's servers use"
            )
        return value

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
        open_router = self.router.enabled and self.router.api_key is None and not self.loopback
        if open_router and self.security.restrict is not Restrict.OFF:
            raise ValueError(
                f"router.api_key is needed: the router listens on {self.bind}, reachable from other machines, "
                "and would serve anyone there; set one, bind 127.0.0.1, or set security.restrict: off to "
                "serve it open on purpose"
            )
        if self.scheduler.max_prefill_chunk > self.scheduler.max_num_batched_tokens:
            raise ValueError("scheduler.max_prefill_chunk must not exceed scheduler.max_num_batched_tokens")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"hosts: names must differ, got {names}")
        for role, spec in (("prefill", self.prefill), ("decode", self.decode)):
            if spec.hosts is not None:
                if len(spec.hosts) != spec.count:
                    raise ValueError(f"{role}.hosts names {len(spec.hosts)} hosts for {spec.count} groups")
                unknown = sorted(set(spec.hosts) - set(names))
                if unknown:
                    raise ValueError(f"{role}.hosts: unknown host {unknown[0]!r} (hosts: {names})")
        self.rank_map()  # placement problems (room, GPUs) are configuration errors, named now
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

    @cached_property
    def multi_host(self) -> bool:
        """Do the ranks run on more than one host? (Then each binds and advertises its host's address.)
        Placed once: the launcher asks this per rank and on every supervision poll."""
        return len({s.host.name if s.host is not None else None for s in self.rank_map()}) > 1

    def rank_map(self) -> list[RankSlot]:
        """Every MPI rank of the deployment, in MPMD order, placed: on the host its group names, or
        packed (the first host with room for the whole group: slots, and GPUs for cuda groups)."""
        slots: list[RankSlot] = []
        placer = _Placer(self.hosts, self.tp_across_hosts)
        groups = [(self.serving_role(), self.decode), (Role.PREFILL, self.prefill)]
        for role, spec in groups:
            if role is Role.PREFILL and self.mode is Mode.COLOCATED:
                continue
            kind = "prefill" if role is Role.PREFILL else "decode"
            for g in range(spec.count):
                what = f"{kind} group {g} (TP {spec.tp}{', cuda' if spec.device is Device.CUDA else ''})"
                wanted = spec.hosts[g] if spec.hosts is not None else None
                places = placer.place(what, spec.tp, spec.device is Device.CUDA, wanted)
                for r, (host, core, gpu) in enumerate(places):
                    if spec.cores is not None:
                        core = spec.cores[g * spec.tp + r]
                    slots.append(RankSlot(len(slots), role, g, r, spec.tp, core, host, gpu, spec.device))
        return slots


@dataclass(frozen=True, slots=True)
class RankSlot:
    mpi_rank: int
    role: Role  # DECODE / COLOCATED (requests enter here) or PREFILL
    group: int
    tp_rank: int
    tp_size: int
    core: int | None = None
    host: HostSpec | None = None  # None: the launching machine
    gpu: int | None = None  # CUDA_VISIBLE_DEVICES of a cuda rank
    device: Device = Device.CPU

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def group_name(self) -> str:
        return group_name(self.role, self.group)

    @property
    def name(self) -> str:
        return f"{self.group_name}.tp{self.tp_rank}"

    def describe(self) -> str:
        kind = "prefill" if self.role is Role.PREFILL else ("decode" if self.role is Role.DECODE else "colocated")
        where = f" on host {self.host.name}" if self.host is not None else ""
        return f"{kind} group {self.group} TP rank {self.tp_rank} (MPI rank {self.mpi_rank}){where}"


_Place = tuple[HostSpec | None, int | None, int | None]  # (host, core, GPU)


class _Placer:
    """Hands out (host, core, GPU) places rank by rank; a group stays on one host unless allowed."""

    def __init__(self, hosts: list[HostSpec], spread: bool) -> None:
        self.hosts, self.spread = hosts, spread
        self.ranks = {h.name: 0 for h in hosts}
        self.gpus = {h.name: 0 for h in hosts}
        self.local_gpus = 0

    def _room(self, h: HostSpec, cuda: bool) -> int:
        ranks = (h.slots - self.ranks[h.name]) if h.slots is not None else 1 << 30
        return min(ranks, len(h.gpus) - self.gpus[h.name]) if cuda else ranks

    def place(
        self, what: str, n: int, cuda: bool, wanted: str | None
    ) -> list[tuple[HostSpec | None, int | None, int | None]]:
        if not self.hosts:  # this machine: GPUs 0, 1, ... in rank order
            start, self.local_gpus = self.local_gpus, self.local_gpus + (n if cuda else 0)
            return [(None, None, start + i if cuda else None) for i in range(n)]
        if wanted is not None:
            host = next(h for h in self.hosts if h.name == wanted)
            room = self._room(host, cuda)
            if room < n:
                kind = "GPUs" if cuda and len(host.gpus) - self.gpus[host.name] < n else "slots"
                raise ValueError(f"{what} does not fit on host {host.name!r}: {room} free {kind} left, it needs {n}")
            return [self._take(host, cuda) for _ in range(n)]
        fits = next((h for h in self.hosts if self._room(h, cuda) >= n), None)
        if fits is not None:
            return [self._take(fits, cuda) for _ in range(n)]
        if not self.spread:
            raise ValueError(
                f"{what} fits on no single host and tp_across_hosts is off "
                f"(free {'GPUs' if cuda else 'slots'}: {[(h.name, self._room(h, cuda)) for h in self.hosts]})"
            )
        places = []
        for _ in range(n):
            h = next((h for h in self.hosts if self._room(h, cuda) > 0), None)
            if h is None:
                raise ValueError(f"{what} does not fit on the hosts: every {'GPU' if cuda else 'slot'} is taken")
            places.append(self._take(h, cuda))
        return places

    def _take(self, h: HostSpec, cuda: bool) -> _Place:
        i = self.ranks[h.name]
        self.ranks[h.name] += 1
        core = h.cores[i] if h.cores is not None and i < len(h.cores) else None
        gpu = None
        if cuda:
            gpu = h.gpus[self.gpus[h.name]]
            self.gpus[h.name] += 1
        return h, core, gpu

"""The launcher's renderer: a cluster config -> a typed ``RunPlan`` (per-rank node configs, one
``mpirun`` command and script per group, ``launch.sh``, the hostfile, the router's config, the
leaders' endpoints). Pure: it starts nothing and reads nothing of running processes; ``write`` puts
a plan into the run directory, where every script is runnable (and editable) by hand.

Every group leader gets its ports (decode group 0 the configured client-facing ones); each rank's
node config names its registry, peers, ports and generation (a restarted group's agents are new
peers). ``Renderer.group`` renders one group again for a restart (its generation + 1).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from frontend.config import GroupEndpoint, RouterConfig
from orchestrator.cluster import ClusterConfig, RankSlot
from orchestrator.router_process import router_config
from orchestrator.triton import (
    NODE_CONFIG_ENV,
    REPO_ROOT,
    Ports,
    Restriction,
    TritonInstall,
    node_repository,
    shm_prefix,
    stub_environment,
    triton_command,
)
from serving.names import Model
from serving.node_config import NodeConfig, RequestTimeouts
from torch_engine.config import EngineConfig, EngineManifest, Role

RUN_ID_ENV = "DISAGG_RUN_ID"
GROUP_ENV = "DISAGG_GROUP"  # the group a process belongs to (its job)
RANK_ENV = "DISAGG_RANK"  # its rank in the deployment (RankSlot.mpi_rank; each job's MPI ranks start at 0)
MULTI_HOST_PORT_BASE = 20000  # other leaders' ports on remote hosts (free ports can be probed only here)


@dataclass(frozen=True, slots=True)
class Leader:
    slot: RankSlot
    ports: Ports
    models: tuple[str, ...]
    address: str = "127.0.0.1"  # where its servers are reached


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One group's ``mpirun`` job at one generation."""

    name: str  # prefill0, decode1, ... (``RankSlot.group_name``)
    role: Role
    group: int
    slots: tuple[RankSlot, ...]
    generation: int
    nodes: dict[Path, NodeConfig]  # each rank's node config, by the path it is written to
    command: list[str]  # the mpirun command
    script_path: Path
    script: str  # the script's text: ``exec`` of the command, with the environment exported

    @property
    def leader(self) -> RankSlot:
        return self.slots[0]


@dataclass(frozen=True, slots=True)
class RunPlan:
    run_dir: Path
    slots: list[RankSlot]
    leaders: list[Leader]
    groups: dict[str, GroupPlan]  # by name, in rank order
    launch_script: str
    hostfile: str | None
    router: RouterConfig | None
    secret: str | None  # the deployment's key for Triton's restricted protocols (written 0600)
    bind: str

    @property
    def script(self) -> Path:
        """``launch.sh``: every group's job."""
        return self.run_dir / "launch.sh"

    @property
    def commands(self) -> dict[str, list[str]]:
        """Each group's mpirun command."""
        return {name: g.command for name, g in self.groups.items()}

    @property
    def router_url(self) -> str | None:
        return f"http://{self.router.host}:{self.router.spec.port}/v1" if self.router is not None else None

    def endpoints(self) -> dict[str, object]:
        out: dict[str, object] = {"router": self.router_url} if self.router_url else {}
        for ld in self.leaders:
            out[ld.slot.group_name] = {
                "address": ld.address,
                "http": ld.ports.http,
                "grpc": ld.ports.grpc,
                "metrics": ld.ports.metrics,
                "models": list(ld.models),
            }
        return out


def address(cfg: ClusterConfig, slot: RankSlot) -> str:
    """Where a rank's servers are reached: its host's address when the deployment spans hosts, else
    the bind address (loopback by default; 127.0.0.1 when binding 0.0.0.0)."""
    if cfg.multi_host and slot.host is not None:
        return slot.host.address
    return "127.0.0.1" if cfg.bind == "0.0.0.0" else cfg.bind


def bind_address(cfg: ClusterConfig, slot: RankSlot) -> str:
    """What a rank's servers bind to: its address, or every interface only when the config says 0.0.0.0."""
    return "0.0.0.0" if cfg.bind == "0.0.0.0" else address(cfg, slot)


def leader_ports(cfg: ClusterConfig, leaders: list[RankSlot]) -> list[Ports]:
    """The first decode group's leader gets the configured ports; the others ``internal_base + 3 * i``
    (``i`` counting leaders on the same host), or free ports when the deployment runs only here."""
    out = []
    on_host: dict[str | None, int] = {}
    for slot in leaders:
        name = slot.host.name if slot.host is not None else None
        i = on_host[name] = on_host.get(name, -1) + 1
        if slot.role is not Role.PREFILL and slot.group == 0:
            out.append(Ports(cfg.ports.http, cfg.ports.grpc, cfg.ports.metrics))
        elif cfg.ports.internal_base is not None or cfg.multi_host:
            base = (cfg.ports.internal_base or MULTI_HOST_PORT_BASE) + 3 * i
            out.append(Ports(base, base + 1, base + 2))
        else:
            out.append(Ports.free(cfg.bind))
    return out


def shm_owner(run_id: str, slot: RankSlot, generation: int) -> str:
    return f"{run_id}_{slot.name.replace('.', '_')}_g{generation}"


class Renderer:
    """Renders a deployment's plan; every input is given (engines built, ports chosen, Triton found)."""

    def __init__(
        self,
        cfg: ClusterConfig,
        run_dir: Path,
        run_id: str,
        install: TritonInstall,
        backends: Path,
        engine_dirs: dict[Role, Path],
        ports: dict[int, Ports],
        auth_key: str | None,
    ) -> None:
        self.cfg, self.run_dir, self.run_id = cfg, run_dir, run_id
        self.install, self.backends, self.dirs, self.ports, self.auth_key = (
            install,
            backends,
            engine_dirs,
            ports,
            auth_key,
        )

    def plan(self) -> RunPlan:
        cfg = self.cfg
        slots = cfg.rank_map()
        by_group: dict[str, list[RankSlot]] = {}
        for slot in slots:
            by_group.setdefault(slot.group_name, []).append(slot)
        groups = {name: self.group(members, 0) for name, members in by_group.items()}
        leaders = [
            Leader(s, self.ports[s.mpi_rank], self.models(s), address(cfg, s)) for s in slots if s.is_leader
        ]  # fmt: skip
        starts = "".join(f"sh {shlex.quote(str(g.script_path))} &\n" for g in groups.values())
        script = (
            "#!/bin/sh\n# Rendered by `disagg launch` from the cluster config: every group's mpirun job (one\n"
            "# script per group, each runnable on its own); run or adapt it by hand.\n"
            f"# Ranks: {', '.join(s.describe() for s in slots)}\n{starts}wait\n"
        )
        hostfile, router = self._hostfile(slots), self._router(leaders)
        return RunPlan(self.run_dir, slots, leaders, groups, script, hostfile, router, self.auth_key, cfg.bind)

    def group(self, slots: list[RankSlot] | tuple[RankSlot, ...], generation: int) -> GroupPlan:
        """One group's node configs and script (its generation in them): one mpirun job."""
        cfg, first = self.cfg, slots[0]
        apps: list[list[str]] = []
        env = self.environment() | {GROUP_ENV: first.group_name}
        nodes: dict[Path, NodeConfig] = {}
        for slot in slots:
            node_path = self.run_dir / "nodes" / f"{slot.name}.yaml"
            nodes[node_path] = self.node(slot, self.ports.get(slot.mpi_rank), generation)
            pin = ["taskset", "-c", str(slot.core)] if slot.core is not None else []
            gpu = [f"CUDA_VISIBLE_DEVICES={slot.gpu}"] if slot.gpu is not None else []
            if slot.is_leader:
                log_file = self.run_dir / "logs" / f"{slot.name}.triton.log"
                repo = REPO_ROOT / "model_repo"
                if self.auth_key is not None:  # no model control: the node's own models, all loaded
                    repo = node_repository(repo, self.models(slot), self.run_dir / "models" / slot.name)
                argv = triton_command(
                    self.install, repo, self.backends, bind_address(cfg, slot),
                    self.ports[slot.mpi_rank], self.models(slot), shm_prefix(shm_owner(self.run_id, slot, generation)),
                    log_file, self.restriction(slot),
                )  # fmt: skip
            else:
                argv = [sys.executable, "-m", "serving.worker", str(node_path)]
            where = ["--host", slot.host.name] if slot.host is not None else []
            if slot.host is not None and slot.host.workdir is not None:
                where += ["--wdir", str(slot.host.workdir)]
            marks = [f"{NODE_CONFIG_ENV}={node_path}", f"{RANK_ENV}={slot.mpi_rank}"]
            apps.append(["-n", "1", *where, "env", *marks, *gpu, *pin, *argv])
        head = [str(Path(sys.executable).parent / "mpirun"), *self.mpi_flags(env)]
        command = list(head)
        for i, app in enumerate(apps):
            command += ([":"] if i else []) + app
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
        body = shlex.join(head) + "".join(f" \\\n  {': ' if i else ''}{shlex.join(app)}" for i, app in enumerate(apps))
        name = first.group_name
        script = (
            f"#!/bin/sh\n# {name} (generation {generation}), rendered by `disagg launch`; runnable by hand.\n"
            f"# Ranks: {', '.join(s.describe() for s in slots)}\n"
            f"cd {shlex.quote(str(REPO_ROOT))}\n{exports}exec {body}\n"
        )
        path = self.run_dir / f"{name}.sh"
        return GroupPlan(name, first.role, first.group, tuple(slots), generation, nodes, command, path, script)

    def models(self, slot: RankSlot) -> tuple[str, ...]:
        if slot.role is Role.PREFILL:
            return (Model.PREFILL,)
        # the client-facing ensemble needs a tokenizer; a tokenizer-less engine serves token ids on `decode`
        has_tokenizer = EngineManifest.load(self.dirs[slot.role]).has_tokenizer
        return (Model.LLM, Model.ENSEMBLE) if has_tokenizer else (Model.DECODE,)

    def restriction(self, slot: RankSlot) -> Restriction | None:
        """No model control on any node, and inference only for callers with the key — the deployment's own
        (decode -> prefill, the router -> decode) and clients given it (``RUN_DIR/secret``). A prefill
        request makes a node write into decode memory; a decode node's ``stop`` aborts live requests."""
        if self.auth_key is None:
            return None
        del slot  # the same on every node
        return Restriction(self.auth_key)

    def environment(self) -> dict[str, str]:
        """What every rank needs: the Triton stub's environment, and this run's id (to find its processes)."""
        env = stub_environment(self.install) | {RUN_ID_ENV: self.run_id}
        env["OMP_NUM_THREADS"] = str(self.cfg.threads_per_rank)
        net = self.cfg.network
        if net.ucx_transports is not None:
            env["UCX_TLS"] = net.ucx_transports
        if net.interface is not None:
            env["UCX_NET_DEVICES"] = net.interface
        elif self.loopback_only:
            env["UCX_NET_DEVICES"] = "lo"  # NIXL's UCX listens on loopback only
        return env

    @property
    def loopback_only(self) -> bool:
        """One host, bound to loopback: nothing of the deployment need listen on another interface."""
        return self.cfg.loopback and not self.cfg.multi_host and self.cfg.network.interface is None

    def mpi_flags(self, env: dict[str, str]) -> list[str]:
        flags = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--output", "tag"]
        net = self.cfg.network
        if net.launch_agent is not None:
            flags += ["--prtemca", "plm_ssh_agent", net.launch_agent]
        if net.interface is not None:
            flags += ["--prtemca", "oob_tcp_if_include", net.interface, "--mca", "btl_tcp_if_include", net.interface]
        elif self.loopback_only:  # MPI between a group's ranks by shared memory: no TCP listener on every interface
            flags += ["--mca", "btl", "self,sm", "--mca", "pml", "ob1"]
        if self.cfg.hosts:
            flags += ["--hostfile", str(self.run_dir / "hostfile")]
        for key in env:
            flags += ["-x", key]
        return flags

    def _hostfile(self, slots: list[RankSlot]) -> str | None:
        if not self.cfg.hosts:
            return None
        placed: dict[str, int] = {}
        for s in slots:
            if s.host is not None:
                placed[s.host.name] = placed.get(s.host.name, 0) + 1
        return "".join(f"{h.name} slots={placed[h.name]}\n" for h in self.cfg.hosts if h.name in placed)

    def _router(self, leaders: list[Leader]) -> RouterConfig | None:
        """The router over every decode group (needs the serving engine's tokenizer; none without one)."""
        cfg = self.cfg
        engine_dir = self.dirs[cfg.serving_role()]
        if not cfg.router.enabled or not EngineManifest.load(engine_dir).has_tokenizer:
            return None
        groups = [
            GroupEndpoint(name=ld.slot.group_name, grpc_url=f"{ld.address}:{ld.ports.grpc}")
            for ld in leaders
            if ld.slot.role is not Role.PREFILL
        ]
        return router_config(cfg.router, cfg.bind, cfg.model, engine_dir, groups, cfg.limits.max_tokens, self.auth_key)

    def node(self, slot: RankSlot, ports: Ports | None, generation: int) -> NodeConfig:
        cfg, spec = self.cfg, self.cfg.spec(slot.role)
        engine: dict[str, object] = {
            "engine_dir": self.dirs[slot.role],
            "dtype": cfg.run_dtype,
            "scheduler": cfg.scheduler,
            "prefix_cache": cfg.prefix_cache,
            "num_threads": cfg.threads_per_rank,
            "device": slot.device.value,  # cuda: the rank sees its one GPU (CUDA_VISIBLE_DEVICES) as cuda:0
        }
        if spec.num_pages is not None:  # else the engine's own default
            engine["num_pages"] = spec.num_pages
        if cfg.kv_dtype is not None:
            engine["kv_dtype"] = cfg.kv_dtype
        if slot.role is not Role.PREFILL:
            engine["speculative"] = cfg.speculative
        here = address(cfg, slot)
        return NodeConfig(
            engine=EngineConfig.model_validate(engine),
            transport=cfg.transport,
            placement=cfg.placement,
            limits=cfg.limits,
            timeouts=RequestTimeouts.model_validate(cfg.timeouts.model_dump(include=set(RequestTimeouts.model_fields))),
            agent_name=f"{self.run_id}-{slot.name}-g{generation}",  # a restarted group's agents are new peers
            role=slot.role,
            group=slot.group,
            tp_rank=slot.tp_rank,
            tp_size=slot.tp_size,
            mpi_rank=slot.mpi_rank,
            host=here,
            grpc_url=f"{here}:{ports.grpc}" if ports is not None else None,
            trace_path=self.run_dir / "traces" / f"{slot.name}.jsonl" if slot.is_leader else None,
            auth_key=self.auth_key,
            registry=self.run_dir / "registry",
            generation=generation,
            peer_groups=self._peer_groups(slot.role),
            startup_s=cfg.timeouts.startup_s,
        )

    def _peer_groups(self, role: Role) -> list[tuple[Role, int]]:
        """The groups a rank of ``role`` reaches: prefill ranks every decode group and vice versa."""
        if role is Role.COLOCATED:
            return []
        other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
        return [(other, g) for g in range(self.cfg.spec(other).count)]


def write_group(group: GroupPlan, secret: bool) -> None:
    """A group's node configs (owner-only: they may carry the key) and script (owner-only with a secret)."""
    for path, node in group.nodes.items():
        node.dump(path)
    group.script_path.write_text(group.script, encoding="utf-8")
    group.script_path.chmod(0o700 if secret else 0o755)


def write(plan: RunPlan) -> None:
    """The plan into its run directory: node configs, scripts, hostfile, secret, router config, endpoints."""
    run_dir = plan.run_dir
    for d in ("nodes", "logs", "traces"):
        (run_dir / d).mkdir(parents=True, exist_ok=True)
    (run_dir / "nodes").chmod(0o700)  # node configs carry the secret
    if plan.secret is not None:
        secret = run_dir / "secret"
        secret.touch(mode=0o600)
        secret.write_text(plan.secret + "\n", encoding="utf-8")
    if plan.hostfile is not None:
        (run_dir / "hostfile").write_text(plan.hostfile, encoding="utf-8")
    for group in plan.groups.values():
        write_group(group, plan.secret is not None)
    plan.script.write_text(plan.launch_script, encoding="utf-8")
    plan.script.chmod(0o700 if plan.secret is not None else 0o755)
    if plan.router is not None:
        plan.router.dump(run_dir / "router.yaml")
    endpoints = plan.endpoints() | {"bind": plan.bind}
    (run_dir / "endpoints.json").write_text(json.dumps(endpoints, indent=2), encoding="utf-8")

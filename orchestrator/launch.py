"""``disagg launch``: cluster config -> engines -> per-rank node configs -> one ``mpirun`` per group -> supervision.

``Launch.prepare`` builds missing engines, gives every group leader its ports (decode group 0
takes the configured client-facing ports), writes one node config per rank, the Triton backend
directory, a hostfile when hosts are listed, one script per group (``<group>.sh``: the exact
``mpirun`` command of that group's ranks) and ``launch.sh``, which starts them all; every script
is runnable (and editable) by hand. Groups find each other through the registry in the run
directory (``serving/registry.py``). ``Launch.start`` starts every group's job; ``wait_ready``
waits until every leader answers ``/v2/health/ready``; ``supervise`` watches every process of
the run and, when a rank dies, names it, withdraws its group from the registry (the other groups
stop routing to it and move its requests), stops the rest of that group's job and restarts the
group after a back-off (``restart:``), at most ``max_restarts`` times; the deployment stops only
when a role has no group left or the router died. ``stop`` is the clean shutdown (SIGTERM to
every job, then SIGKILL to anything of this run still alive, found by the run id that every rank
inherits in its environment).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from builders import BuildOptions, build_engine
from builders.build import default_engine_dir
from frontend.config import GroupEndpoint
from orchestrator.cluster import ClusterConfig, RankSlot
from orchestrator.router_process import RouterProcess, render
from orchestrator.triton import (
    NODE_CONFIG_ENV,
    REPO_ROOT,
    Ports,
    Restriction,
    TritonInstall,
    backend_dir,
    http_ready,
    port_free,
    remove_shm,
    shm_prefix,
    stop_group,
    stub_environment,
    triton_command,
)
from serving.names import Model
from serving.node_config import NodeConfig, RequestTimeouts
from serving.registry import Registry
from torch_engine.config import EngineConfig, EngineManifest, Role

RUN_ID_ENV = "DISAGG_RUN_ID"
GROUP_ENV = "DISAGG_GROUP"  # the group a process belongs to (its job)
RANK_ENV = "DISAGG_RANK"  # its rank in the deployment (RankSlot.mpi_rank; each job's MPI ranks start at 0)


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Leader:
    slot: RankSlot
    ports: Ports
    models: tuple[str, ...]
    address: str = "127.0.0.1"  # where its servers are reached


class JobState(enum.IntEnum):
    """A group's mpirun job: STARTING -> UP -> (a rank died) BACKING_OFF -> STARTING ... or FAILED."""

    STARTING = 0  # started; its leader is not ready yet
    UP = 1
    BACKING_OFF = 2  # died; restarts at ``retry_at``
    FAILED = 3  # died with no restart left


@dataclass(slots=True)
class GroupJob:
    name: str  # prefill0, decode1, ...
    role: Role
    group: int
    slots: list[RankSlot]
    script: Path
    command: list[str] = field(default_factory=list)
    generation: int = 0  # restarts so far
    state: JobState = JobState.STARTING
    proc: subprocess.Popen[bytes] | None = None
    pids: dict[int, int] = field(default_factory=dict)  # watched processes once up: pid -> deployment rank
    retry_at: float = 0.0
    ready_by: float = 0.0

    @property
    def log(self) -> Path:
        return self.script.with_suffix(".log")

    @property
    def leader(self) -> RankSlot:
        return self.slots[0]


@dataclass(frozen=True, slots=True)
class Prepared:
    script: Path
    commands: dict[str, list[str]]  # each group's mpirun command
    leaders: list[Leader]
    slots: list[RankSlot]
    run_dir: Path
    router_url: str | None = None

    def endpoints(self) -> dict[str, object]:
        out: dict[str, object] = {"router": self.router_url} if self.router_url else {}
        for ld in self.leaders:
            role = "prefill" if ld.slot.role is Role.PREFILL else "decode"
            out[f"{role}{ld.slot.group}"] = {
                "address": ld.address,
                "http": ld.ports.http,
                "grpc": ld.ports.grpc,
                "metrics": ld.ports.metrics,
                "models": list(ld.models),
            }
        return out


def engine_dirs(cfg: ClusterConfig, progress: bool = True) -> dict[Role, Path]:
    """The engine of each role (built here if missing; cached by checkpoint fingerprint)."""
    dirs: dict[Role, Path] = {}
    roles = [(cfg.serving_role(), cfg.decode)] + ([(Role.PREFILL, cfg.prefill)] if cfg.prefill.count else [])
    for role, spec in roles:
        if spec.engine_dir is not None:
            manifest = EngineManifest.load(spec.engine_dir)
            if manifest.tp_size != spec.tp:
                raise LaunchError(f"{spec.engine_dir} was built for TP {manifest.tp_size}, the config asks {spec.tp}")
            dirs[role] = spec.engine_dir
            continue
        opts = BuildOptions(
            role=role,
            tp_size=spec.tp,
            dtype=cfg.dtype,
            page_size=cfg.page_size,
            kv_layout=cfg.kv_layout,
            mtp_head=cfg.mtp_head,
        )
        dirs[role] = build_engine(cfg.model, default_engine_dir(cfg.engine_cache, cfg.model, opts), opts, progress)
    return dirs


log = logging.getLogger(__name__)

# what mpirun (PRRTE) prints when a rank dies: it notices on every host, the launcher only on its own
PRRTE_DEATH = re.compile(
    r"process rank (?P<rank>\d+) with PID (?P<pid>\d+) on node (?P<node>\S+) exited on (?P<how>signal \d+|status \d+)"
)
MULTI_HOST_PORT_BASE = 20000  # other leaders' ports on remote hosts (free ports can be probed only here)


def _ports(cfg: ClusterConfig, leaders: list[RankSlot]) -> list[Ports]:
    """The first decode group's leader gets the configured ports; the others ``internal_base + 3 * i``
    (``i`` counting leaders on the same host), or free ports when the deployment runs only here."""
    out = []
    on_host: dict[str | None, int] = {}
    multi = cfg.multi_host
    for slot in leaders:
        name = slot.host.name if slot.host is not None else None
        i = on_host[name] = on_host.get(name, -1) + 1
        if slot.role is not Role.PREFILL and slot.group == 0:
            out.append(Ports(cfg.ports.http, cfg.ports.grpc, cfg.ports.metrics))
        elif cfg.ports.internal_base is not None or multi:
            base = (cfg.ports.internal_base or MULTI_HOST_PORT_BASE) + 3 * i
            out.append(Ports(base, base + 1, base + 2))
        else:
            out.append(Ports.free(cfg.bind))
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


class Launch:
    def __init__(self, cfg: ClusterConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run_dir).resolve()
        self.run_id = uuid.uuid4().hex[:12]
        self.prepared: Prepared | None = None
        self.jobs: dict[str, GroupJob] = {}  # by group name, in rank order
        self.running = False
        self.events: list[str] = []  # what supervision saw and did (also in run_dir/supervisor.log)
        self.router: RouterProcess | None = None
        # the deployment's secret for Triton's restricted protocols (run_dir/secret, mode 0600)
        self.auth_key: str | None = secrets.token_urlsafe(24) if cfg.restricted else None

    # -- rendering -----------------------------------------------------------------------
    def prepare(self, install: TritonInstall | None = None, progress: bool = True) -> Prepared:
        cfg = self.cfg
        install = install or TritonInstall.find()
        dirs = engine_dirs(cfg, progress)
        for d in ("nodes", "logs", "traces"):
            (self.run_dir / d).mkdir(parents=True, exist_ok=True)
        (self.run_dir / "nodes").chmod(0o700)  # node configs carry the secret
        if self.auth_key is not None:
            secret = self.run_dir / "secret"
            secret.touch(mode=0o600)
            secret.write_text(self.auth_key + "\n", encoding="utf-8")
        backends = backend_dir(install, self.run_dir / "backends")
        if cfg.bind == "0.0.0.0":
            log.warning("bind 0.0.0.0: every server listens on every interface (the config says so)")
        slots = cfg.rank_map()
        leader_slots = [s for s in slots if s.is_leader]
        self._ports = dict(zip([s.mpi_rank for s in leader_slots], _ports(cfg, leader_slots), strict=True))
        self._dirs, self._install, self._backends = dirs, install, backends
        registry = self.run_dir / "registry"
        shutil.rmtree(registry, ignore_errors=True)  # a previous run's records
        registry.mkdir()
        self.jobs = {}
        for slot in slots:
            name = slot.name.split(".")[0]
            if name not in self.jobs:
                self.jobs[name] = GroupJob(name, slot.role, slot.group, [], self.run_dir / f"{name}.sh")
            self.jobs[name].slots.append(slot)
        for job in self.jobs.values():
            self._render_group(job)
        leaders = [
            Leader(s, self._ports[s.mpi_rank], self._models(s, dirs[s.role]), address(cfg, s)) for s in leader_slots
        ]
        script = self.run_dir / "launch.sh"
        starts = "".join(f"sh {shlex.quote(str(j.script))} &\n" for j in self.jobs.values())
        script.write_text(
            "#!/bin/sh\n# Rendered by `disagg launch` from the cluster config: every group's mpirun job (one\n"
            "# script per group, each runnable on its own); run or adapt it by hand.\n"
            f"# Ranks: {', '.join(s.describe() for s in slots)}\n{starts}wait\n",
            encoding="utf-8",
        )
        script.chmod(0o700 if self.auth_key is not None else 0o755)
        self.router = self._router(leaders, dirs[cfg.serving_role()])
        router_url = f"{self.router.url}/v1" if self.router is not None else None
        commands = {name: job.command for name, job in self.jobs.items()}
        self.prepared = Prepared(script, commands, leaders, slots, self.run_dir, router_url)
        endpoints = self.prepared.endpoints() | {"bind": self.cfg.bind}
        (self.run_dir / "endpoints.json").write_text(json.dumps(endpoints, indent=2), encoding="utf-8")
        return self.prepared

    def _render_group(self, job: GroupJob) -> None:
        """The group's node configs (its generation in them) and its script: one mpirun job."""
        cfg, install = self.cfg, self._install
        apps: list[list[str]] = []
        env = self._environment(install) | {GROUP_ENV: job.name}
        for slot in job.slots:
            engine_dir = self._dirs[slot.role]
            node_path = self._write_node(slot, engine_dir, self._ports.get(slot.mpi_rank), job.generation)
            pin = ["taskset", "-c", str(slot.core)] if slot.core is not None else []
            gpu = [f"CUDA_VISIBLE_DEVICES={slot.gpu}"] if slot.gpu is not None else []
            if slot.is_leader:
                models = self._models(slot, engine_dir)
                log_file = self.run_dir / "logs" / f"{slot.name}.triton.log"
                argv = triton_command(
                    install, REPO_ROOT / "model_repo", self._backends, bind_address(cfg, slot),
                    self._ports[slot.mpi_rank], models, shm_prefix(self._shm_owner(slot, job.generation)), log_file,
                    self._restriction(slot),
                )  # fmt: skip
            else:
                argv = [sys.executable, "-m", "serving.worker", str(node_path)]
            where = ["--host", slot.host.name] if slot.host is not None else []
            if slot.host is not None and slot.host.workdir is not None:
                where += ["--wdir", str(slot.host.workdir)]
            marks = [f"{NODE_CONFIG_ENV}={node_path}", f"{RANK_ENV}={slot.mpi_rank}"]
            apps.append(["-n", "1", *where, "env", *marks, *gpu, *pin, *argv])
        command = [str(Path(sys.executable).parent / "mpirun"), *self._mpi_flags(env)]
        for i, app in enumerate(apps):
            command += ([":"] if i else []) + app
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
        head = shlex.join(command[: len(command) - sum(len(a) for a in apps) - (len(apps) - 1)])
        body = head + "".join(f" \\\n  {': ' if i else ''}{shlex.join(app)}" for i, app in enumerate(apps))
        job.script.write_text(
            f"#!/bin/sh\n# {job.name} (generation {job.generation}), rendered by `disagg launch`; runnable by hand.\n"
            f"# Ranks: {', '.join(s.describe() for s in job.slots)}\n"
            f"cd {shlex.quote(str(REPO_ROOT))}\n{exports}exec {body}\n",
            encoding="utf-8",
        )
        job.script.chmod(0o700 if self.auth_key is not None else 0o755)  # with the secret in it: the owner only
        job.command = command

    def _shm_owner(self, slot: RankSlot, generation: int) -> str:
        return f"{self.run_id}_{slot.name.replace('.', '_')}_g{generation}"

    def _router(self, leaders: list[Leader], engine_dir: Path) -> RouterProcess | None:
        """The router over every decode group (needs the serving engine's tokenizer; none without one)."""
        cfg = self.cfg
        if not cfg.router.enabled or not EngineManifest.load(engine_dir).has_tokenizer:
            return None
        groups = [
            GroupEndpoint(name=ld.slot.name.split(".")[0], grpc_url=f"{address(cfg, ld.slot)}:{ld.ports.grpc}")
            for ld in leaders
            if ld.slot.role is not Role.PREFILL
        ]
        path = self.run_dir / "router.yaml"
        router = render(cfg.router, cfg.bind, cfg.model, engine_dir, groups, cfg.limits.max_tokens, path)
        env = {RUN_ID_ENV: self.run_id, "OMP_NUM_THREADS": "1"}
        return RouterProcess(path, router, self.run_dir / "logs" / "router.log", env)

    def _environment(self, install: TritonInstall) -> dict[str, str]:
        """What every rank needs: the Triton stub's environment, and this run's id (to find its processes)."""
        env = stub_environment(install) | {RUN_ID_ENV: self.run_id, "OMP_NUM_THREADS": str(self.cfg.threads_per_rank)}
        net = self.cfg.network
        if net.ucx_transports is not None:
            env["UCX_TLS"] = net.ucx_transports
        if net.interface is not None:
            env["UCX_NET_DEVICES"] = net.interface
        return env

    def _mpi_flags(self, env: dict[str, str]) -> list[str]:
        flags = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--output", "tag"]
        net = self.cfg.network
        if net.launch_agent is not None:
            flags += ["--prtemca", "plm_ssh_agent", net.launch_agent]
        if net.interface is not None:
            flags += ["--prtemca", "oob_tcp_if_include", net.interface, "--mca", "btl_tcp_if_include", net.interface]
        if self.cfg.hosts:
            placed: dict[str, int] = {}
            for s in self.cfg.rank_map():
                if s.host is not None:
                    placed[s.host.name] = placed.get(s.host.name, 0) + 1
            lines = [f"{h.name} slots={placed[h.name]}" for h in self.cfg.hosts if h.name in placed]
            hostfile = self.run_dir / "hostfile"
            hostfile.write_text("\n".join(lines) + "\n", encoding="utf-8")
            flags += ["--hostfile", str(hostfile)]
        for key in env:
            flags += ["-x", key]
        return flags

    def _models(self, slot: RankSlot, engine_dir: Path) -> tuple[str, ...]:
        if slot.role is Role.PREFILL:
            return (Model.PREFILL,)
        # the client-facing ensemble needs a tokenizer; a tokenizer-less engine serves token ids on `decode`
        return (Model.LLM, Model.ENSEMBLE) if EngineManifest.load(engine_dir).has_tokenizer else (Model.DECODE,)

    def _restriction(self, slot: RankSlot) -> Restriction | None:
        """Model control on every node; on prefill nodes also inference (a prefill request makes the
        node write into decode memory): only the deployment's own callers, which carry the key."""
        if self.auth_key is None:
            return None
        protocols = ("model-repository", "inference") if slot.role is Role.PREFILL else ("model-repository",)
        return Restriction(protocols, self.auth_key)

    def _write_node(self, slot: RankSlot, engine_dir: Path, ports: Ports | None, generation: int) -> Path:
        cfg, spec = self.cfg, self.cfg.spec(slot.role)
        engine: dict[str, object] = {
            "engine_dir": engine_dir,
            "dtype": cfg.run_dtype,
            "scheduler": cfg.scheduler,
            "num_threads": cfg.threads_per_rank,
            "device": slot.device.value,  # cuda: the rank sees its one GPU (CUDA_VISIBLE_DEVICES) as cuda:0
        }
        if spec.num_pages is not None:  # else the engine's own default
            engine["num_pages"] = spec.num_pages
        if slot.role is not Role.PREFILL:
            engine["speculative"] = cfg.speculative
        node = NodeConfig(
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
            host=address(cfg, slot),
            grpc_url=f"{address(cfg, slot)}:{ports.grpc}" if ports is not None else None,
            trace_path=self.run_dir / "traces" / f"{slot.name}.jsonl" if slot.is_leader else None,
            auth_key=self.auth_key,
            registry=self.run_dir / "registry",
            generation=generation,
            peer_groups=self._peer_groups(slot.role),
            startup_s=cfg.timeouts.startup_s,
        )
        path = self.run_dir / "nodes" / f"{slot.name}.yaml"
        node.dump(path)
        return path

    def _peer_groups(self, role: Role) -> list[tuple[Role, int]]:
        """The groups a rank of ``role`` reaches: prefill ranks every decode group and vice versa."""
        if role is Role.COLOCATED:
            return []
        other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
        return [(other, g) for g in range(self.cfg.spec(other).count)]

    # -- running -------------------------------------------------------------------------
    def start(self) -> None:
        prepared = self.prepared or self.prepare()
        for ld in prepared.leaders:
            for name, port in (("http", ld.ports.http), ("grpc", ld.ports.grpc), ("metrics", ld.ports.metrics)):
                here = address(self.cfg, ld.slot)
                if not self.cfg.multi_host and not port_free(here, port):
                    raise LaunchError(f"{ld.slot.describe()}: {name} port {here}:{port} is already in use")
        if self.router is not None and not port_free(self.cfg.bind, self.cfg.router.port):
            raise LaunchError(f"the router's port {self.cfg.bind}:{self.cfg.router.port} is already in use")
        self.running = True
        for job in self.jobs.values():
            self._start_job(job)
        if self.router is not None:
            self.router.start(_die_with_parent)

    def _start_job(self, job: GroupJob) -> None:
        with job.log.open("ab") as out:  # a restarted group's output follows the previous one's
            job.proc = subprocess.Popen(
                ["sh", str(job.script)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - one prctl before exec; mpirun dies with the launcher
            )
        job.state, job.pids = JobState.STARTING, {}
        job.ready_by = time.monotonic() + self.cfg.timeouts.startup_s

    def _leader_ready(self, job: GroupJob) -> bool:
        ports = self._ports[job.leader.mpi_rank]
        return http_ready(address(self.cfg, job.leader), ports.http)

    def wait_ready(self) -> None:
        """Until every leader is ready; a rank that dies first, or the startup timeout, is an error."""
        assert self.prepared is not None and self.running
        deadline = time.monotonic() + self.cfg.timeouts.startup_s
        pending = list(self.jobs.values())
        while pending:
            for job in pending:
                if job.proc is not None and job.proc.poll() is not None:
                    raise LaunchError(f"{job.name} exited during start-up:\n{self.failure_report(job)}")
            if time.monotonic() > deadline:
                report = "\n".join(self.failure_report(j) for j in pending)
                self.stop()
                raise LaunchError(f"not ready after {self.cfg.timeouts.startup_s:.0f} s:\n{report}")
            pending = [j for j in pending if not self._leader_ready(j)]
            time.sleep(0.25)
        self._wait_router(deadline)
        alive = run_processes(self.run_id)
        for job in self.jobs.values():
            job.state, job.pids = JobState.UP, self._pids_of(job, alive)

    def _pids_of(self, job: GroupJob, alive: dict[int, int]) -> dict[int, int]:
        ranks = {s.mpi_rank for s in job.slots}
        return {pid: rank for pid, rank in alive.items() if rank in ranks}

    def _wait_router(self, deadline: float) -> None:
        router = self.router
        while router is not None and not router.ready():
            if router.exited() is not None:
                raise LaunchError(f"the router exited during start-up:\n{router.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"the router is not ready after {self.cfg.timeouts.startup_s:.0f} s")
            time.sleep(0.25)

    def supervise(self, poll_s: float = 0.5) -> str | None:
        """Watch the groups until ``stop``: restart a group whose rank died (``check``). Returns the
        reason when the deployment had to stop (a role with no group left, the router gone)."""
        while self.running:
            message = self.check()
            if message is not None:
                self.stop()
                return message
            time.sleep(poll_s)
        return None

    def check(self) -> str | None:
        """One supervision pass: notice deaths, restart due groups, mark restarted groups up.
        Returns the reason the deployment cannot go on, if it cannot."""
        if self.router is not None and (code := self.router.exited()) is not None:
            return f"deployment stopped: the router exited with code {code}\n{self.router.log_tail()}"
        local = not self.cfg.multi_host  # other hosts' ranks: mpirun's own report (its job ends)
        alive = run_processes(self.run_id) if local else {}
        now = time.monotonic()
        for job in self.jobs.values():
            exited = job.proc is not None and job.proc.poll() is not None
            if job.state is JobState.UP:
                dead = [(pid, rank) for pid, rank in job.pids.items() if pid not in alive] if local else []
                if dead or exited:
                    self._group_died(job, self._death_message(job, dead))
            elif job.state is JobState.STARTING:
                if exited:
                    self._group_died(job, f"{job.name} exited while restarting\n{self.failure_report(job)}")
                elif self._leader_ready(job):
                    job.state, job.pids = JobState.UP, self._pids_of(job, run_processes(self.run_id))
                    self._event(f"{job.name} restarted (generation {job.generation}) and serves again")
                elif now > job.ready_by:
                    self._group_died(job, f"{job.name} not ready {self.cfg.timeouts.startup_s:.0f} s after a restart")
            elif job.state is JobState.BACKING_OFF and now >= job.retry_at:
                self._restart(job)
        for role in {j.role for j in self.jobs.values()}:
            if all(j.state is JobState.FAILED for j in self.jobs.values() if j.role is role):
                return f"deployment stopped: every {role.value} group failed for good\n" + "\n".join(self.events[-5:])
        return None

    def _group_died(self, job: GroupJob, message: str) -> None:
        """Withdraw the group (its peers stop routing to it and move its requests), end its job, and
        schedule its restart or give up on it."""
        self._event(message)
        Registry(self.run_dir / "registry").withdraw(job.role, job.group)
        self._end_job(job)
        spec = self.cfg.restart
        if job.generation >= spec.max_restarts:
            job.state = JobState.FAILED
            self._event(f"{job.name} stays down: {spec.max_restarts} restarts used")
            return
        wait = min(spec.backoff_s * 2**job.generation, spec.max_backoff_s)
        job.state, job.retry_at = JobState.BACKING_OFF, time.monotonic() + wait
        self._event(f"restarting {job.name} in {wait:.1f} s (restart {job.generation + 1} of {spec.max_restarts})")

    def _restart(self, job: GroupJob) -> None:
        job.generation += 1
        self._render_group(job)
        self._start_job(job)
        self._event(f"{job.name} started again (generation {job.generation})")

    def _end_job(self, job: GroupJob) -> None:
        """SIGTERM to the group's mpirun (it takes its ranks down), then SIGKILL to what is left of it."""
        if job.proc is not None:
            stop_group(job.proc, self.cfg.timeouts.shutdown_s)
        deadline = time.monotonic() + self.cfg.timeouts.shutdown_s / 2
        while run_processes(self.run_id, job.name) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in run_processes(self.run_id, job.name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for slot in job.slots:
            remove_shm(shm_prefix(self._shm_owner(slot, job.generation)))
        job.pids = {}

    def _event(self, message: str) -> None:
        log.warning("%s", message)
        self.events.append(message)
        with (self.run_dir / "supervisor.log").open("a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n")

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(pid, deployment rank) of processes of running groups that are gone (ranks on this machine
        only: across hosts mpirun's own failure report says it)."""
        if self.cfg.multi_host:
            return []
        alive = run_processes(self.run_id)
        up = [j for j in self.jobs.values() if j.state is JobState.UP]
        return [(p, r) for j in up for p, r in j.pids.items() if p not in alive]

    def _death_message(self, job: GroupJob, dead: list[tuple[int, int]]) -> str:
        by_rank = {s.mpi_rank: s for s in job.slots}
        report = self.failure_report(job)
        if dead:
            names = sorted({by_rank[r].describe() for _, r in dead if r in by_rank})
            pids = ", ".join(str(p) for p, _ in dead)
            return f"{'; '.join(names)} died (pid {pids})\n{report}"
        raw = job.log.read_text(encoding="utf-8", errors="replace")[-20000:] if job.log.exists() else ""
        notices = list(PRRTE_DEATH.finditer(" ".join(raw.split())))  # mpirun's own, wherever the rank ran
        found = notices[-1] if notices else None  # the last: this death's (the log spans restarts)
        if found is not None and int(found["rank"]) < len(job.slots):
            slot, how = job.slots[int(found["rank"])], found["how"]  # the job's MPI rank = TP rank
            return f"{slot.describe()} died ({how}, pid {found['pid']})\n{report}"
        return f"{job.name}'s mpirun exited\n{report}"

    def failure_report(self, job: GroupJob | None = None, lines: int = 25) -> str:
        """The last lines of a group's mpirun output (every group's when ``job`` is None)."""
        out = []
        for j in [job] if job is not None else list(self.jobs.values()):
            text = j.log.read_text(encoding="utf-8", errors="replace").splitlines() if j.log.exists() else []
            out += [f"[{j.name}] {line}" for line in text[-lines:]]
        return "\n".join(out)

    def stop(self) -> int | None:
        """SIGTERM to every group's mpirun (each takes its ranks down), then SIGKILL to any process of
        this run left. Returns the worst exit code of the jobs (None when nothing ran)."""
        grace = self.cfg.timeouts.shutdown_s
        if self.router is not None:
            self.router.stop(grace)
        if not self.running:
            return None
        self.running = False
        codes = [stop_group(j.proc, grace) for j in self.jobs.values() if j.proc is not None]
        deadline = time.monotonic() + grace / 2
        while run_processes(self.run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in run_processes(self.run_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        remove_shm(shm_prefix(self.run_id))  # what killed Python-backend stubs left in /dev/shm
        for j in self.jobs.values():
            j.proc = None
        return max(codes, key=abs) if codes else None


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to send SIGTERM when the launcher dies (PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def run_processes(run_id: str, group: str | None = None) -> dict[int, int]:
    """pid -> deployment rank of every rank process on this host whose environment carries this run
    id (and ``group``'s name, when given)."""
    found: dict[int, int] = {}
    marker = f"{RUN_ID_ENV}={run_id}".encode()
    in_group = f"{GROUP_ENV}={group}".encode() if group is not None else None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if marker not in env or stat.rsplit(")", 1)[-1].split()[0] == "Z":
            continue
        if in_group is not None and in_group not in env:
            continue
        rank = next((v for v in env if v.startswith(f"{RANK_ENV}=".encode())), None)
        if rank is not None:
            found[int(entry.name)] = int(rank.split(b"=", 1)[1])
    return found

"""The launcher's supervisor: runs a rendered plan's groups and keeps them up.

``start`` starts every group's ``mpirun`` job (and the router); ``wait_ready`` waits until every
leader answers ``/v2/health/ready``; ``check`` (one pass; ``supervise`` loops it) watches every
process of the run and, when a rank dies, names it, withdraws its group from the registry (the
other groups stop routing to it and move its requests), stops the rest of that group's job and
restarts the group after a back-off (``restart:``) — rendered again at its next generation —, at
most ``max_restarts`` times; the deployment stops only when a role has no group left or the router
died. ``stop`` is the clean shutdown (SIGTERM to every job, then SIGKILL to anything of this run
still alive, found by the run id that every rank inherits in its environment).

Per group: STARTING ──leader ready──> UP ──a rank died──> BACKING_OFF ──back-off over──> STARTING
(rendered at generation + 1) ... ──no restart left──> FAILED.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.cluster import ClusterConfig
from orchestrator.router_process import RouterProcess
from orchestrator.run_plan import (
    GROUP_ENV,
    RANK_ENV,
    RUN_ID_ENV,
    GroupPlan,
    Renderer,
    RunPlan,
    address,
    shm_owner,
    write_group,
)
from orchestrator.triton import http_ready, port_free, remove_shm, shm_prefix, stop_group
from serving.registry import Registry
from torch_engine.config import Role

log = logging.getLogger(__name__)

# what mpirun (PRRTE) prints when a rank dies: it notices on every host, the launcher only on its own
PRRTE_DEATH = re.compile(
    r"process rank (?P<rank>\d+) with PID (?P<pid>\d+) on node (?P<node>\S+) exited on (?P<how>signal \d+|status \d+)"
)


class LaunchError(RuntimeError):
    pass


class JobState(enum.IntEnum):
    """A group's mpirun job: STARTING -> UP -> (a rank died) BACKING_OFF -> STARTING ... or FAILED."""

    STARTING = 0  # started; its leader is not ready yet
    UP = 1
    BACKING_OFF = 2  # died; restarts at ``retry_at``
    FAILED = 3  # died with no restart left


@dataclass(slots=True)
class GroupJob:
    plan: GroupPlan  # the current generation's
    state: JobState = JobState.STARTING
    proc: subprocess.Popen[bytes] | None = None
    pids: dict[int, int] = field(default_factory=dict)  # watched processes once up: pid -> deployment rank
    retry_at: float = 0.0
    ready_by: float = 0.0

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def role(self) -> Role:
        return self.plan.role

    @property
    def generation(self) -> int:
        return self.plan.generation

    @property
    def script(self) -> Path:
        return self.plan.script_path

    @property
    def log(self) -> Path:
        return self.plan.script_path.with_suffix(".log")


class Supervisor:
    def __init__(
        self, cfg: ClusterConfig, plan: RunPlan, renderer: Renderer, run_id: str, router: RouterProcess | None
    ) -> None:
        self.cfg, self.plan, self.renderer, self.run_id, self.router = cfg, plan, renderer, run_id, router
        self.run_dir = plan.run_dir
        self.jobs = {name: GroupJob(g) for name, g in plan.groups.items()}  # by group name, in rank order
        self.running = False
        self.events: list[str] = []  # what supervision saw and did (also in run_dir/supervisor.log)

    def start(self) -> None:
        for ld in self.plan.leaders:
            for name, port in (("http", ld.ports.http), ("grpc", ld.ports.grpc), ("metrics", ld.ports.metrics)):
                if not self.cfg.multi_host and not port_free(ld.address, port):
                    raise LaunchError(f"{ld.slot.describe()}: {name} port {ld.address}:{port} is already in use")
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
        leader = job.plan.leader
        return http_ready(address(self.cfg, leader), self.renderer.ports[leader.mpi_rank].http)

    def wait_ready(self) -> None:
        """Until every leader is ready; a rank that dies first, or the startup timeout, is an error."""
        assert self.running
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
        ranks = {s.mpi_rank for s in job.plan.slots}
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
        Registry(self.run_dir / "registry").withdraw(job.role, job.plan.group)
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
        """One group again, rendered at its next generation (fresh agents: its peers connect anew)."""
        job.plan = self.renderer.group(job.plan.slots, job.generation + 1)
        write_group(job.plan, self.plan.secret is not None)
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
        for slot in job.plan.slots:
            remove_shm(shm_prefix(shm_owner(self.run_id, slot, job.generation)))
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
        slots = job.plan.slots
        by_rank = {s.mpi_rank: s for s in slots}
        report = self.failure_report(job)
        if dead:
            names = sorted({by_rank[r].describe() for _, r in dead if r in by_rank})
            pids = ", ".join(str(p) for p, _ in dead)
            return f"{'; '.join(names)} died (pid {pids})\n{report}"
        raw = job.log.read_text(encoding="utf-8", errors="replace")[-20000:] if job.log.exists() else ""
        notices = list(PRRTE_DEATH.finditer(" ".join(raw.split())))  # mpirun's own, wherever the rank ran
        found = notices[-1] if notices else None  # the last: this death's (the log spans restarts)
        if found is not None and int(found["rank"]) < len(slots):
            slot, how = slots[int(found["rank"])], found["how"]  # the job's MPI rank = TP rank
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

"""``disagg launch``: cluster config -> engines -> a rendered run plan -> one ``mpirun`` per group -> supervision.

``Launch`` is the two rooms behind one door: ``prepare`` builds missing engines, picks the leaders'
ports and renders the plan (``orchestrator/run_plan.py``: node configs, one script per group,
``launch.sh``, hostfile, router config; pure, then written to the run directory); ``start`` /
``wait_ready`` / ``supervise`` / ``check`` / ``stop`` run it (``orchestrator/supervisor.py``: a
dead rank's group is withdrawn, ended and restarted at its next generation). Groups find each
other through the registry in the run directory (``serving/registry.py``).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import uuid
from pathlib import Path

from builders import BuildOptions, build_engine
from builders.build import default_engine_dir
from orchestrator.cluster import ClusterConfig
from orchestrator.router_process import RouterProcess
from orchestrator.run_plan import RUN_ID_ENV, Renderer, RunPlan, leader_ports, write
from orchestrator.supervisor import GroupJob, JobState, LaunchError, Supervisor, run_processes
from orchestrator.triton import TritonInstall, backend_dir
from torch_engine.config import EngineManifest, Role
from torch_engine.quant import QuantKind

__all__ = ["JobState", "Launch", "LaunchError", "engine_dirs", "run_processes"]

log = logging.getLogger(__name__)


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
            weights=cfg.weights,
            quantize=QuantKind[cfg.quantize.upper()] if cfg.quantize else None,
        )
        dirs[role] = build_engine(cfg.model, default_engine_dir(cfg.engine_cache, cfg.model, opts), opts, progress)
    return dirs


class Launch:
    def __init__(self, cfg: ClusterConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run_dir).resolve()
        self.run_id = uuid.uuid4().hex[:12]
        self.prepared: RunPlan | None = None
        self.supervisor: Supervisor | None = None
        # the deployment's secret for Triton's restricted protocols (run_dir/secret, mode 0600)
        self.auth_key: str | None = secrets.token_urlsafe(24) if cfg.restricted else None

    def prepare(self, install: TritonInstall | None = None, progress: bool = True) -> RunPlan:
        """Engines built, ports picked, the plan rendered and written; nothing started."""
        cfg = self.cfg
        install = install or TritonInstall.find()
        dirs = engine_dirs(cfg, progress)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        backends = backend_dir(install, self.run_dir / "backends")
        if cfg.bind == "0.0.0.0":
            log.warning("bind 0.0.0.0: every server listens on every interface (the config says so)")
        leaders = [s for s in cfg.rank_map() if s.is_leader]
        ports = dict(zip([s.mpi_rank for s in leaders], leader_ports(cfg, leaders), strict=True))
        registry = self.run_dir / "registry"
        shutil.rmtree(registry, ignore_errors=True)  # a previous run's records
        registry.mkdir()
        renderer = Renderer(cfg, self.run_dir, self.run_id, install, backends, dirs, ports, self.auth_key)
        plan = renderer.plan()
        write(plan)
        router = None
        if plan.router is not None:
            env = {RUN_ID_ENV: self.run_id, "OMP_NUM_THREADS": "1"}
            router = RouterProcess(self.run_dir / "router.yaml", plan.router, self.run_dir / "logs" / "router.log", env)
        self.supervisor = Supervisor(cfg, plan, renderer, self.run_id, router)
        self.prepared = plan
        return plan

    def _running(self) -> Supervisor:
        if self.supervisor is None:
            self.prepare()
        assert self.supervisor is not None
        return self.supervisor

    @property
    def jobs(self) -> dict[str, GroupJob]:
        """Each group's job, by group name (empty before ``prepare``)."""
        return self.supervisor.jobs if self.supervisor is not None else {}

    @property
    def router(self) -> RouterProcess | None:
        return self.supervisor.router if self.supervisor is not None else None

    @property
    def events(self) -> list[str]:
        """What supervision saw and did (also in run_dir/supervisor.log)."""
        return self.supervisor.events if self.supervisor is not None else []

    @property
    def running(self) -> bool:
        return self.supervisor is not None and self.supervisor.running

    @running.setter
    def running(self, value: bool) -> None:
        """True adopts jobs started by hand from the rendered scripts (found by the run id)."""
        self._running().running = value

    def start(self) -> None:
        self._running().start()

    def wait_ready(self) -> None:
        self._running().wait_ready()

    def supervise(self, poll_s: float = 0.5) -> str | None:
        return self._running().supervise(poll_s)

    def check(self) -> str | None:
        return self._running().check()

    def dead_ranks(self) -> list[tuple[int, int]]:
        return self._running().dead_ranks()

    def failure_report(self, job: GroupJob | None = None, lines: int = 25) -> str:
        return self._running().failure_report(job, lines)

    def stop(self) -> int | None:
        return self.supervisor.stop() if self.supervisor is not None else None

"""Find, provision, start and stop a ``tritonserver`` (the binary from the ``nvidia-pytriton`` wheel).

``backend_dir`` assembles what Triton's ``--backend-directory`` needs: ``python/`` (Triton's
Python backend and the 3.11 stub) and ``disagg_backend/`` (our Python-based backend, a copy of
``backends/disagg_backend/``). ``TritonServer`` starts the binary bound to 127.0.0.1 by default,
with the environment the stub needs (the venv's ``python3`` first on ``PATH``, the wheel's
libraries and the interpreter's ``lib/`` on ``LD_LIBRARY_PATH``), waits for readiness, and
stops it. A missing binary, a port in use, or a server that exits early are clear errors.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from serving.auth import FORWARD_PATTERN
from serving.node_config import NODE_CONFIG_ENV
from serving.ports import free_port, port_free

__all__ = ["NODE_CONFIG_ENV", "Ports", "TritonServer", "free_port", "port_free"]

REPO_ROOT = Path(__file__).resolve().parent.parent


class TritonError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class TritonInstall:
    binary: Path
    libs: Path
    python_backend: Path
    stub: Path

    @classmethod
    def find(cls) -> TritonInstall:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or spec.origin is None:
            raise TritonError(
                "tritonserver is not installed: pip install nvidia-pytriton==0.7.0 (make setup does this)"
            )
        root = Path(spec.origin).parent / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        install = cls(
            binary=root / "bin" / "tritonserver",
            libs=root.parent.parent / "nvidia_pytriton.libs",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        )
        for path in (install.binary, install.libs, install.python_backend, install.stub):
            if not path.exists():
                raise TritonError(f"the nvidia-pytriton install is incomplete: {path} is missing")
        return install


def backend_dir(install: TritonInstall, dest: Path) -> Path:
    """Assemble ``dest/python`` and ``dest/disagg_backend``; returns ``dest``."""
    python = dest / "python"
    shutil.rmtree(python, ignore_errors=True)
    shutil.copytree(install.python_backend, python, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(install.stub, python / "triton_python_backend_stub")
    ours = dest / "disagg_backend"
    shutil.rmtree(ours, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "backends" / "disagg_backend", ours, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@dataclass(frozen=True, slots=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls, host: str = "127.0.0.1") -> Ports:
        return cls(free_port(host), free_port(host), free_port(host))


def triton_command(
    install: TritonInstall,
    model_repo: Path,
    backends: Path,
    host: str,
    ports: Ports,
    models: tuple[str, ...],
    shm_prefix: str,
    log_file: Path | None = None,
    restrict: Restriction | None = None,
) -> list[str]:
    """``tritonserver`` bound to ``host``, explicit model control loading ``models``; the Python backend's
    shared-memory regions are named ``shm_prefix...`` so that ``remove_shm`` finds what a killed stub left.
    Locked (``restrict``): no model control at all (``model_repo`` must be the node's own, ``node_repository``:
    Triton loads all of it and refuses every load / unload / index call), and the key's header forwarded into
    each request's parameters, where the backend checks it (``serving.auth``) — the key itself is never on
    the command line."""
    if restrict is not None:
        control = ["--model-control-mode=none"]
        locks = [f"--grpc-header-forward-pattern={FORWARD_PATTERN}", f"--http-header-forward-pattern={FORWARD_PATTERN}"]
    else:
        control = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]
        locks = []
    return [
        str(install.binary),
        f"--model-repository={model_repo}",
        f"--backend-directory={backends}",
        f"--http-address={host}",
        f"--http-port={ports.http}",
        f"--grpc-address={host}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-address={host}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        "--log-verbose=0",
        "--disable-auto-complete-config",  # every config is complete: no stub launched per model to ask
        *([f"--log-file={log_file}"] if log_file is not None else []),
        *control,
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        *locks,
    ]


@dataclass(frozen=True, slots=True)
class Restriction:
    """A locked node: model control off, inference only for calls carrying ``AUTH_HEADER: key`` (checked
    by the backend against its node config's key; ``key`` is kept here only to say which)."""

    key: str


def node_repository(model_repo: Path, models: tuple[str, ...], dest: Path) -> Path:
    """``dest`` holding links to ``models`` of ``model_repo`` and the steps their ensembles run: what a
    node without model control loads, all of it."""
    wanted, todo = set(), list(models)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += re.findall(r'model_name:\s*"([^"]+)"', (model_repo / name / "config.pbtxt").read_text())
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in sorted(wanted):
        (dest / name).symlink_to((model_repo / name).resolve(), target_is_directory=True)
    return dest


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session``), SIGKILL after ``grace_s``;
    its exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


SHM_DIR = Path("/dev/shm")


def shm_prefix(owner: str) -> str:
    """The prefix of one server's Python-backend shared-memory regions (``owner``: a run or server id)."""
    return f"disagg_{owner}_"


def remove_shm(prefix: str) -> int:
    """Unlink the shared-memory regions named ``prefix...`` (a stopped server's, left by killed stubs)."""
    removed = 0
    for region in SHM_DIR.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            region.unlink()
            removed += 1
    return removed


def stub_environment(install: TritonInstall) -> dict[str, str]:
    """What the isolated Python stub needs on top of the caller's environment: this venv's
    ``python3`` first on ``PATH``, the wheel's and the interpreter's libraries."""
    venv_bin = str(Path(sys.executable).parent)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    return {
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
        "LD_LIBRARY_PATH": os.pathsep.join(
            p for p in (str(install.libs), libdir, os.environ.get("LD_LIBRARY_PATH")) if p
        ),
    }


def http_ready(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class TritonServer:
    def __init__(
        self,
        model_repo: Path,
        run_dir: Path,
        node_config: Path,
        ports: Ports = Ports(),
        host: str = "127.0.0.1",
        install: TritonInstall | None = None,
        models: tuple[str, ...] = ("llm", "ensemble"),
    ) -> None:
        self.install = install or TritonInstall.find()
        self.model_repo = Path(model_repo)
        self.run_dir = Path(run_dir)
        self.node_config = Path(node_config)
        self.ports = ports
        self.host = host
        self.models = models  # what this node loads (an ensemble brings its steps): llm / prefill
        self.log_path = self.run_dir / "tritonserver.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm_prefix = shm_prefix(uuid.uuid4().hex[:12])

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    def command(self, backends: Path) -> list[str]:
        return triton_command(
            self.install, self.model_repo, backends, self.host, self.ports, self.models, self.shm_prefix
        )

    def environment(self) -> dict[str, str]:
        env = dict(os.environ) | stub_environment(self.install)
        env[NODE_CONFIG_ENV] = str(self.node_config)
        env.pop("PYTHONPATH", None)
        return env

    def start(self, timeout_s: float = 120.0) -> TritonServer:
        for name, port in (("http", self.ports.http), ("grpc", self.ports.grpc), ("metrics", self.ports.metrics)):
            if not port_free(self.host, port):
                raise TritonError(f"{name} port {self.host}:{port} is already in use")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        backends = backend_dir(self.install, self.run_dir / "backends")
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.command(backends), stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TritonError(f"tritonserver exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise TritonError(f"tritonserver was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        return http_ready(self.host, self.ports.http)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        code = stop_group(self.proc, timeout_s)
        self.proc = None
        remove_shm(self.shm_prefix)
        return code

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def perf_analyzer_env(install: TritonInstall, link_dir: Path) -> dict[str, str]:
    """Environment in which the ``perf_analyzer`` of the ``tritonclient`` wheel runs: it needs
    ``libb64.so.0d`` and ``libcudart.so.12``, which ``nvidia_pytriton.libs`` ships under hashed names."""
    link_dir.mkdir(parents=True, exist_ok=True)
    for soname, prefix in (("libb64.so.0d", "libb64-"), ("libcudart.so.12", "libcudart-")):
        found = sorted(install.libs.glob(prefix + "*"))
        if not found:
            raise TritonError(f"{install.libs} has no {soname} for perf_analyzer")
        link = link_dir / soname
        if not link.exists():
            link.symlink_to(found[0])
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(link_dir), env.get("LD_LIBRARY_PATH")) if p)
    return env

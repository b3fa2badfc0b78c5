"""The deployment's router process (``python -m frontend``): rendered, started, probed and stopped
by the launcher next to ``mpirun``; it runs on the launcher's host, bound like every other server.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from frontend.config import GroupEndpoint, RouterConfig, RouterSpec
from orchestrator.triton import REPO_ROOT, stop_group

log = logging.getLogger("orchestrator.router")


def served_model_name(spec: RouterSpec, model: str) -> str:
    """The model id clients send: the configured one, else the checkpoint's name ('smollm2', a folder's or file's)."""
    return spec.served_model_name or Path(model).stem


def router_config(
    spec: RouterSpec,
    bind: str,
    model: str,
    engine_dir: Path,
    groups: list[GroupEndpoint],
    max_tokens: int,
    node_key: str | None = None,
) -> RouterConfig:
    return RouterConfig(
        spec=spec, host=bind, model_name=served_model_name(spec, model), engine_dir=engine_dir, groups=groups,
        max_tokens_limit=max_tokens, node_key=node_key,
    )  # fmt: skip


class RouterProcess:
    def __init__(self, config_path: Path, cfg: RouterConfig, log_path: Path, environment: dict[str, str]) -> None:
        self.config_path = config_path
        self.cfg = cfg
        self.log_path = log_path
        self.environment = environment
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.spec.port}"

    def start(self, preexec: Callable[[], None]) -> None:
        out = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "frontend", str(self.config_path)],
            cwd=REPO_ROOT,
            env=os.environ | self.environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,  # noqa: PLW1509 - one prctl before exec: dies with the launcher
        )

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def ready(self) -> bool:
        """``/health`` answers 200: at least one decode group is in rotation."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 15) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s)
            self.proc = None

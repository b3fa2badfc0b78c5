"""Run inside an emulated host (``tests/e2e/test_emulated_deploy.py``): launch a deployment from a
cluster config, send token-id prompts to decode group 0, write what came back, stop.

    python -m tests.emulated_deploy CONFIG.yaml PROMPTS.json OUT.json [--kill-prefill-group G]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from orchestrator.cluster import ClusterConfig
from orchestrator.launch import Launch, run_processes
from tests.deploy_harness import run_ids


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config", type=Path)
    p.add_argument("prompts", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kill", default=None, help="after the prompts, SIGKILL this rank (e.g. prefill1.tp0), supervise")
    a = p.parse_args()
    cfg = ClusterConfig.load(a.config)
    prompts = json.loads(a.prompts.read_text())
    launch = Launch(cfg)
    launch.prepare(progress=False)
    out: dict[str, object] = {}
    launch.start()
    try:
        launch.wait_ready()
        assert launch.prepared is not None
        decode = next(ld for ld in launch.prepared.leaders if ld.slot.name == "decode0.tp0")
        got = run_ids(f"{decode.address}:{decode.ports.grpc}", prompts, a.max_tokens)
        out["tokens"] = [c.token_ids for c in got]
        out["errors"] = [c.error for c in got]
        out["leaders"] = {ld.slot.name: ld.address for ld in launch.prepared.leaders}
        if a.kill is not None:
            rank = next(s.mpi_rank for s in launch.prepared.slots if s.name == a.kill)
            victim = next(pid for pid, r in run_processes(launch.run_id).items() if r == rank)
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            out["message"] = launch.supervise(poll_s=0.2)
            out["named_after_s"] = time.monotonic() - t0
    finally:
        launch.stop()
        out["left"] = len(run_processes(launch.run_id))
        a.out.write_text(json.dumps(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

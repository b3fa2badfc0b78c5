"""Run inside an emulated host (``tests/e2e/test_emulated_deploy.py``): launch a deployment from a
cluster config, send token-id prompts to decode group 0, write what came back, stop.

    python -m tests.emulated_deploy CONFIG.yaml PROMPTS.json OUT.json [--kill GROUP]

With ``--kill``: the prompts again (three times over) as load, every process of GROUP (e.g.
prefill1) killed meanwhile, supervision until the group is restarted, the prompts once more, and
whether the restarted group served any of them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

from orchestrator.client import Completion
from orchestrator.cluster import ClusterConfig
from orchestrator.launch import JobState, Launch, run_processes
from tests.deploy_harness import run_ids


def served_requests(where: str, model: str) -> float:
    """Successful inferences of ``model`` a Triton server counted since it started."""
    with urllib.request.urlopen(f"http://{where}/metrics", timeout=10) as r:
        text = r.read().decode()
    rows = [x for x in text.splitlines() if x.startswith("nv_inference_request_success") and f'model="{model}"' in x]
    return sum(float(x.rsplit(" ", 1)[1]) for x in rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config", type=Path)
    p.add_argument("prompts", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kill", default=None, help="under load, SIGKILL every process of this group (e.g. prefill1)")
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
        got = run_ids(f"{decode.address}:{decode.ports.grpc}", prompts, a.max_tokens, key=launch.auth_key)
        out["tokens"] = [c.token_ids for c in got]
        out["errors"] = [c.error for c in got]
        out["leaders"] = {ld.slot.name: ld.address for ld in launch.prepared.leaders}
        if a.kill is not None:
            url = f"{decode.address}:{decode.ports.grpc}"
            load: list[Completion] = []
            thread = threading.Thread(
                target=lambda: load.extend(run_ids(url, prompts * 3, a.max_tokens, "load", launch.auth_key))
            )
            thread.start()
            time.sleep(0.3)
            victims = run_processes(launch.run_id, a.kill)  # one PID namespace: the emulated hosts' too
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            t0, job = time.monotonic(), launch.jobs[a.kill]
            while not (job.state is JobState.UP and job.generation == 1) and time.monotonic() - t0 < 180:
                assert launch.check() is None, launch.events
                if launch.events and "named_after_s" not in out:  # supervision named the death
                    out["named_after_s"] = time.monotonic() - t0
                time.sleep(0.2)
            thread.join(timeout=120)
            out["killed"] = len(victims)
            out["load_tokens"] = [c.token_ids for c in load]
            out["load_errors"] = [c.error for c in load]
            out["events"] = launch.events
            again = run_ids(url, prompts, a.max_tokens, "again", launch.auth_key)
            out["again_tokens"] = [c.token_ids for c in again]
            leader = next(ld for ld in launch.prepared.leaders if ld.slot.name == f"{a.kill}.tp0")
            served = 0.0
            for _ in range(20):  # eight at once: the router spreads them by load
                run_ids(url, prompts, 2, "spread", launch.auth_key)
                served = served_requests(f"{leader.address}:{leader.ports.metrics}", "prefill")
                if served:
                    break
            out["served_again"] = served
    finally:
        launch.stop()
        out["left"] = len(run_processes(launch.run_id))
        a.out.write_text(json.dumps(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

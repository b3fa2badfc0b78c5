"""Failure isolation: every group is its own mpirun job, so a dead group costs only its own
in-flight work; the launcher withdraws it from the registry (its peers stop routing to it and move
its requests), restarts it after a back-off, and it rejoins once its new ranks published theirs."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc

from orchestrator.client import Completion
from orchestrator.launch import JobState, Launch, run_processes
from tests.deploy_harness import cluster, deployed, grpc_url, run_ids, wait_busy
from tests.helpers import prompt_of, tiny_engine
from torch_engine.sampling import SamplingParams

SCHED = {"max_num_seqs": 16, "max_num_batched_tokens": 32, "max_prefill_chunk": 16}
RESTART = {"max_restarts": 2, "backoff_s": 0.5}


def isolated_cfg(tmp, engine_dir, prefill_groups: int, decode_groups: int):
    return cluster(
        tmp,
        mode="disaggregated",
        prefill={"count": prefill_groups, "tp": 1, "engine_dir": str(engine_dir), "num_pages": 256},
        decode={"count": decode_groups, "tp": 1, "engine_dir": str(engine_dir), "num_pages": 256},
        page_size=4,
        scheduler=SCHED,
        restart=RESTART,
        timeouts={"startup_s": 240, "kv_transfer_s": 30, "shutdown_s": 10, "prefill_request_s": 5},
    )


def kill_group(launch: Launch, name: str) -> int:
    victims = run_processes(launch.run_id, name)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    return len(victims)


def supervise_until_restarted(launch: Launch, name: str, timeout_s: float = 180) -> float:
    """Run the launcher's supervision passes until ``name`` is up again after one restart; seconds taken."""
    start = time.monotonic()
    job = launch.jobs[name]
    while not (job.state is JobState.UP and job.generation == 1):
        assert launch.check() is None, launch.events
        assert time.monotonic() - start < timeout_s, f"{name} not back: {launch.events}"
        time.sleep(0.2)
    return time.monotonic() - start


def served(port: int, model: str) -> float:
    """Successful inferences of ``model`` a Triton server counted (since it started)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [x for x in text.splitlines() if x.startswith("nv_inference_request_success") and f'model="{model}"' in x]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def test_a_dead_prefill_group_is_withdrawn_restarted_and_rejoins(tiny_engine_dir, tmp_path) -> None:
    """Two prefill groups, one decode group. Under load, every process of prefill group 1 is
    killed: no request hangs (each completes with the plain tokens, or ends with a clear error),
    the decode group keeps serving through prefill group 0, group 1 is restarted, rejoins the
    routing and takes requests again; the supervisor's log names what died and what restarted."""
    engine = tiny_engine_dir("llama")
    prompts = [prompt_of(n, n) for n in (9, 17, 23, 31, 40, 47, 57, 63)] * 3
    want = tiny_engine(engine).generate(prompts, SamplingParams(max_tokens=16))
    with deployed(isolated_cfg(tmp_path, engine, 2, 1)) as launch:
        url = grpc_url(launch)
        assert all(c.error is None for c in run_ids(url, prompts[:8], 4, tag="warm"))
        results: list[Completion] = []
        load = threading.Thread(target=lambda: results.extend(run_ids(url, prompts, 16, tag="load")))
        load.start()
        wait_busy(launch, "prefill1.tp0")
        assert kill_group(launch, "prefill1") >= 1
        took = supervise_until_restarted(launch, "prefill1")
        load.join(timeout=120)
        assert not load.is_alive(), "requests hang"
        after = run_ids(url, prompts[:8], 16, tag="after")
        # the restarted group takes requests again (eight at once: the router spreads them by load)
        assert launch.prepared is not None
        p1 = next(ld for ld in launch.prepared.leaders if ld.slot.name == "prefill1.tp0")
        deadline = time.monotonic() + 30
        while served(p1.ports.metrics, "prefill") == 0 and time.monotonic() < deadline:
            assert all(c.error is None for c in run_ids(url, prompts[:8], 2, tag="spread"))
        assert served(p1.ports.metrics, "prefill") > 0
        events = (launch.run_dir / "supervisor.log").read_text()
    assert len(results) == len(prompts)
    for c, w in zip(results, want, strict=True):
        assert c.token_ids == w if c.error is None else "prefill" in c.error or "KV" in c.error, c.error
    assert sum(c.error is None for c in results) >= len(prompts) // 2
    assert [c.token_ids for c in after] == want[:8]
    assert "prefill group 1 TP rank 0" in events and "died" in events, events
    assert "prefill1 restarted (generation 1)" in events, events
    assert took < 120


def test_a_dead_decode_group_costs_only_its_streams(tiny_engine_dir, tmp_path) -> None:
    """Two decode groups behind one prefill group: killing decode group 1 ends its own requests
    with an error; decode group 0 keeps serving meanwhile; group 1 comes back on the same ports
    and serves again (the prefill group connects to its new ranks)."""
    engine = tiny_engine_dir("llama")
    prompts = [prompt_of(n, 100 + n) for n in (9, 17, 23, 31)]
    want = tiny_engine(engine).generate(prompts, SamplingParams(max_tokens=16))
    with deployed(isolated_cfg(tmp_path, engine, 1, 2)) as launch:
        url0, url1 = grpc_url(launch, 0), grpc_url(launch, 1)
        assert [c.token_ids for c in run_ids(url1, prompts, 16, tag="before")] == want
        doomed: list[Completion | Exception] = []

        def doomed_load() -> None:
            try:
                doomed.extend(run_ids(url1, prompts * 4, 400, tag="doomed"))  # long streams: cut by the kill
            except grpc.aio.AioRpcError as exc:  # the stream broke: the client sees the death as an error
                doomed.append(exc)

        load = threading.Thread(target=doomed_load)
        load.start()
        wait_busy(launch, "decode1.tp0")
        assert kill_group(launch, "decode1") >= 1
        during = run_ids(url0, prompts, 16, tag="during")  # the other group serves meanwhile
        supervise_until_restarted(launch, "decode1")
        load.join(timeout=60)
        assert not load.is_alive()
        again = run_ids(url1, prompts, 16, tag="again")
    assert [c.token_ids for c in during] == want
    assert [c.token_ids for c in again] == want
    assert any(isinstance(c, Exception) or c.error is not None for c in doomed)  # its clients saw it, as errors

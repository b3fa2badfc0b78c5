"""End-to-end deployments launched through mpirun, as ``disagg launch`` does (orchestrator issue).

Every test starts its own deployment on free 127.0.0.1 ports and checks on the way out that no
process of the run is left.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.launch import Launch, run_processes
from orchestrator.triton import port_free, stop_group
from tests.deploy_harness import cluster, deployed, grpc_url, run_ids, run_texts
from tests.helpers import prompt_of, tiny_engine
from torch_engine.config import EngineConfig, Role, SchedulerConfig, SpecMethod, SpeculativeConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

SCHED = {"max_num_seqs": 16, "max_num_batched_tokens": 16, "max_prefill_chunk": 8}
PROMPTS = [prompt_of(n, n) for n in (2, 5, 9, 17, 23, 31, 40, 57)]


def tiny_cfg(tmp: Path, engine_dir, kind: str, prefill_tp: int, decode_tp: int, decode_groups: int = 1):
    return cluster(
        tmp,
        mode="disaggregated",
        prefill={"count": 1, "tp": prefill_tp, "engine_dir": str(engine_dir(kind, prefill_tp)), "num_pages": 256},
        decode={
            "count": decode_groups,
            "tp": decode_tp,
            "engine_dir": str(engine_dir(kind, decode_tp)),
            "num_pages": 256,
        },
        page_size=4,
        scheduler=SCHED,
    )


def page_metric(port: int, state: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("disagg_kv_pages") and f'state="{state}"' in x)
    return float(line.rsplit(" ", 1)[1])


def reference(engine_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The colocated TP 1 engine's tokens, its prefix cache off (deployments run with theirs on)."""
    return tiny_engine(engine_dir, prefix_cache=False).generate(prompts, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(("kind", "prefill_tp", "decode_tp"), [("llama", 2, 1), ("llama", 1, 2), ("deepseek_v3", 2, 1)])
def test_tp_mismatch_equals_colocated_tp1(
    kind: str, prefill_tp: int, decode_tp: int, tiny_engine_dir, tmp_path
) -> None:
    want = reference(tiny_engine_dir(kind, 1), PROMPTS, 12)
    with deployed(tiny_cfg(tmp_path, tiny_engine_dir, kind, prefill_tp, decode_tp)) as launch:
        got = run_ids(grpc_url(launch), PROMPTS, 12)
        # a second turn of each: the decoder's prefix cache holds the history, the prefill node writes the rest
        follow = [p + c.token_ids + prompt_of(5, 900 + i) for i, (p, c) in enumerate(zip(PROMPTS, got, strict=True))]
        warm = run_ids(grpc_url(launch), follow, 12)
    assert [c.error for c in got + warm] == [None] * 2 * len(PROMPTS)
    assert [c.token_ids for c in got] == want
    assert [c.token_ids for c in warm] == reference(tiny_engine_dir(kind, 1), follow, 12)


def test_two_decode_groups_share_one_prefill_group(tiny_engine_dir, tmp_path) -> None:
    want = reference(tiny_engine_dir("llama", 1), PROMPTS, 10)
    with deployed(tiny_cfg(tmp_path, tiny_engine_dir, "llama", 1, 1, decode_groups=2)) as launch:
        import asyncio

        import tritonclient.grpc.aio as aioclient

        from orchestrator.client import generate_ids

        async def go():
            clients = [aioclient.InferenceServerClient(grpc_url(launch, g)) for g in (0, 1)]
            try:  # interleaved: request i goes to decode group i % 2, all at once
                jobs = [generate_ids(clients[i % 2], p, 10, f"i{i}") for i, p in enumerate(PROMPTS)]
                return await asyncio.gather(*jobs)
            finally:
                for c in clients:
                    await c.close()

        got = asyncio.run(go())
        # bad input on a disaggregated decode node: a clear error, nothing leaks, it keeps serving
        bad = run_ids(grpc_url(launch), [[1, 2, 10**6]], 4, tag="bad") + run_ids(grpc_url(launch), [[3, 4]], 0)
        assert "outside the vocabulary" in (bad[0].error or "") and "max_tokens" in (bad[1].error or "")
        assert run_ids(grpc_url(launch), PROMPTS[:1], 10, tag="after")[0].token_ids == want[0]
        assert launch.prepared is not None
        metrics = launch.prepared.leaders[0].ports.metrics
        deadline = time.monotonic() + 10
        while page_metric(metrics, "used") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert page_metric(metrics, "used") == 0 and page_metric(metrics, "pinned") == 0
        traces = sorted((launch.run_dir / "traces").glob("*.jsonl"))
    assert [c.error for c in got] == [None] * len(PROMPTS)
    assert [c.token_ids for c in got] == want
    assert {t.name for t in traces} >= {"decode0.tp0.jsonl", "decode1.tp0.jsonl", "prefill0.tp0.jsonl"}


def test_smollm2_disaggregated_equals_colocated_equals_engine(smollm2_dir: Path, tmp_path: Path) -> None:
    """8 concurrent requests of different lengths, greedy fp32, over Triton gRPC streaming."""
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "List three prime numbers:",
        "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
        "Explain in one sentence what a KV cache is.",
        "1, 2, 3, 4,",
        "Translate 'good morning' into Spanish:",
        "The quick brown fox jumps over the lazy dog. " * 6 + "Summarise that.",
    ]
    n = 16
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=512, scheduler=SchedulerConfig(max_num_seqs=8)))
    tok = engine.tokenizer
    assert tok is not None
    want_ids = engine.generate([tok.encode(t) for t in texts], SamplingParams(max_tokens=n))
    want_text = [tok.decode(ids) for ids in want_ids]
    common = {"prefill": {"count": 0}, "decode": {"engine_dir": str(smollm2_dir), "num_pages": 512}}
    results = {}
    for mode in ("disaggregated", "colocated"):
        fields = dict(common, mode=mode)
        if mode == "disaggregated":
            fields["prefill"] = {"count": 1, "engine_dir": str(smollm2_dir), "num_pages": 512}
        with deployed(cluster(tmp_path / mode, **fields)) as launch:
            url = grpc_url(launch)
            streamed = run_texts(url, texts, n)
            ids = run_ids(url, [tok.encode(t) for t in texts], n)
        results[mode] = ([c.text for c in streamed], [c.token_ids for c in ids], [c.error for c in streamed + ids])
    for mode, (got_text, got_ids, errors) in results.items():
        assert errors == [None] * 16, mode
        assert got_ids == want_ids, mode
        assert got_text == want_text, mode


def test_generated_mpirun_script_runs_on_its_own(tiny_engine_dir, tmp_path) -> None:
    cfg = tiny_cfg(tmp_path, tiny_engine_dir, "llama", 1, 1)
    launch = Launch(cfg)
    prepared = launch.prepare(progress=False)
    assert "prefill0.sh &" in prepared.script.read_text() and "decode0.sh &" in prepared.script.read_text()
    log = (launch.run_dir / "by-hand.log").open("wb")
    proc = subprocess.Popen(["sh", str(prepared.script)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    launch.running = True  # adopt what it starts: readiness wait and shutdown find the ranks by the run id
    try:
        launch.wait_ready()
        got = run_ids(grpc_url(launch), PROMPTS[:3], 6)
    finally:
        launch.stop()
        stop_group(proc, 10)
        log.close()
    assert [c.token_ids for c in got] == reference(tiny_engine_dir("llama", 1), PROMPTS[:3], 6)
    assert run_processes(launch.run_id) == {}


def test_disagg_launch_cli_demo_then_ctrl_c(smollm2_dir: Path, tmp_path: Path) -> None:
    """What `make serve` runs: launch, stream one chat answer with TTFT / ITL, serve, Ctrl-C stops all."""
    cfg = cluster(
        tmp_path,
        prefill={"count": 1, "engine_dir": str(smollm2_dir), "num_pages": 256},
        decode={"count": 1, "engine_dir": str(smollm2_dir), "num_pages": 256},
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(json.loads(cfg.model_dump_json())), encoding="utf-8")  # JSON is YAML
    cli = str(Path(sys.executable).parent / "disagg")
    proc = subprocess.Popen(
        [cli, "launch", str(path), "--demo", "What is 2+2?", "--max-tokens", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(lines)
        assert "TTFT" in text and "ITL" in text, text
        assert f"grpc 127.0.0.1:{cfg.ports.grpc}" in text, text
        script = (cfg.run_dir / "decode0.sh").read_text(encoding="utf-8")  # each group's job exports the run id
        run_id = script.split("DISAGG_RUN_ID=", 1)[1].split()[0]
        assert run_processes(run_id)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, text + rest
        assert "stopped" in rest
        assert run_processes(run_id) == {}
        assert all(port_free(cfg.bind, p) for p in (cfg.ports.http, cfg.ports.grpc, cfg.ports.metrics))
    finally:  # whatever failed above, the launcher (and with it the deployment) does not outlive the test
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_colocated_tp2_equals_tp1(tiny_engine_dir, tmp_path) -> None:
    """Colocated TP groups broadcast bare steps (no messenger commands, no gather)."""
    cfg = cluster(
        tmp_path,
        mode="colocated",
        prefill={"count": 0},
        decode={"count": 1, "tp": 2, "engine_dir": str(tiny_engine_dir("llama", 2)), "num_pages": 256},
        page_size=4,
        scheduler=SCHED,
    )
    with deployed(cfg) as launch:
        got = run_ids(grpc_url(launch), PROMPTS, 8)
    assert [c.token_ids for c in got] == reference(tiny_engine_dir("llama", 1), PROMPTS, 8)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_speculating_decode_group_equals_colocated(tiny_engine_dir, tmp_path, prefill_tp: int, decode_tp: int) -> None:
    """The decode group drafts n-gram tokens and verifies them (TP 1 and TP 2); the prefill group
    (another TP size) never samples: greedy tokens equal plain decoding, and drafts were accepted."""
    cfg = tiny_cfg(tmp_path, tiny_engine_dir, "llama", prefill_tp, decode_tp)
    cfg = cfg.model_copy(update={"speculative": SpeculativeConfig(method=SpecMethod.NGRAM, num_tokens=4)})
    phrase = prompt_of(6, 77)
    prompts = [(phrase * 8)[:n] for n in (13, 30, 47)] + PROMPTS[2:5]
    with deployed(cfg) as launch:
        got = run_ids(grpc_url(launch), prompts, 24)
        assert launch.prepared is not None
        decode = next(ld for ld in launch.prepared.leaders if ld.slot.role is not Role.PREFILL)
        with urllib.request.urlopen(f"http://127.0.0.1:{decode.ports.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
    assert [c.token_ids for c in got] == reference(tiny_engine_dir("llama", 1), prompts, 24)
    accepted = next(x for x in text.splitlines() if x.startswith("disagg_draft_tokens_total") and "accepted" in x)
    assert float(accepted.rsplit(" ", 1)[1]) > 0, accepted


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_mtp_decode_group_across_tp_mismatch_equals_colocated(kind: str, mtp_engine_dir, tmp_path) -> None:
    """Prefill TP 2 -> decode TP 1 drafting with the MTP module: the prefill streams the MTP layer's
    KV with the others and hands over its last hidden state (the decoder's metadata slots), the
    decoder drafts its first step from it; greedy tokens equal plain decoding."""
    cfg = tiny_cfg(tmp_path, mtp_engine_dir, kind, 2, 1)
    cfg = cfg.model_copy(update={"speculative": SpeculativeConfig(method=SpecMethod.MTP, num_tokens=1)})
    prompts = PROMPTS[1:]  # prompts of >= 2 tokens: every one is split

    def proposed(port: int) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        line = next(x for x in text.splitlines() if x.startswith("disagg_draft_tokens_total") and "proposed" in x)
        return float(line.rsplit(" ", 1)[1])

    with deployed(cfg) as launch:
        assert launch.prepared is not None
        decode = next(ld for ld in launch.prepared.leaders if ld.slot.role is not Role.PREFILL)
        # two tokens each: only a first step seeded by the shipped hidden state can draft (the
        # second token is the last, so the second step has no room for a draft)
        short = run_ids(grpc_url(launch), prompts, 2)
        seeded = proposed(decode.ports.metrics)
        got = run_ids(grpc_url(launch), prompts, 12)
    assert [c.error for c in short + got] == [None] * 2 * len(prompts)
    assert seeded == len(prompts)
    assert [c.token_ids for c in short] == reference(mtp_engine_dir(kind, 1), prompts, 2)
    assert [c.token_ids for c in got] == reference(mtp_engine_dir(kind, 1), prompts, 12)

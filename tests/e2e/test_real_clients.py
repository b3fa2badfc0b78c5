"""The benchmark clients our users run against OpenAI-compatible servers — NVIDIA's AIPerf and
guidellm — run unchanged (each from its own venv: ``make clients``) against the router of a real
disaggregated deployment, streamed chat, bounded (12 requests each). What they report is checked,
not their exit code: every request completed without an error, each got exactly the tokens asked
for, the prompt tokens the server reported equal our tokenizer's count of what the tool sent
through the chat template, time to first token and inter-token latency were measured, and the
prefix cache's ``cached_tokens`` reached them as whole pages."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.launch import Launch
from serving.ports import free_port
from tests.deploy_harness import cluster, deployed
from torch_engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / ".venv-clients"
KEY = "client-key-42"
REQUESTS, PROMPT, OUTPUT, PAGE = 12, 64, 16, 16


def tool(name: str) -> Path:
    path = CLIENTS / name / "bin" / name
    if not path.exists():
        pytest.skip(f"{name} is not installed ({path}): run `make clients`")
    return path


@pytest.fixture(scope="module")
def deployment(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    groups = {"engine_dir": str(smollm2_dir), "num_pages": 256}
    cfg = cluster(
        tmp_path_factory.mktemp("clients"), page_size=PAGE, prefill={"count": 1, **groups},
        decode={"count": 1, **groups}, router={"enabled": True, "port": free_port(), "api_key": KEY},
    )  # fmt: skip
    with deployed(cfg) as launch:
        yield launch


def _target(launch: Launch) -> str:
    assert launch.prepared is not None and launch.prepared.router_url is not None
    return launch.prepared.router_url.removesuffix("/v1")


def _run(cmd: list[str], cwd: Path) -> str:
    # AIPerf 0.13 in HF offline mode looks a local tokenizer folder up as a hub repo id: run them as installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    done = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def _text(content: Any) -> str:
    """A message's text: a string, or OpenAI's list of content parts."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def test_aiperf_runs_unchanged_and_reports_what_was_served(deployment: Launch, smollm2_dir: Path, tmp_path) -> None:
    out = tmp_path / "aiperf"
    _run([str(tool("aiperf")), "profile", "-m", "smollm2", "--url", _target(deployment), "--api-key", KEY,
          "--endpoint-type", "chat", "--streaming", "--tokenizer", str(smollm2_dir),
          "--prompt-input-tokens-mean", str(PROMPT), "--prompt-input-tokens-stddev", "0",
          "--prompt-output-tokens-mean", str(OUTPUT), "--prompt-output-tokens-stddev", "0",
          "--extra-inputs", "ignore_eos:true", "--concurrency", "2", "--request-count", str(REQUESTS),
          "--random-seed", "1", "--output-artifact-dir", str(out), "--ui", "none"], tmp_path)  # fmt: skip
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == REQUESTS and not summary["error_summary"], summary["error_summary"]
    assert summary["was_cancelled"] is False
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS and all("error" not in r or r["error"] is None for r in records)
    sent = {s["session_id"]: s["payloads"][0] for s in json.loads((out / "inputs.json").read_text())["data"]}
    tok = Tokenizer(smollm2_dir)
    for r in records:
        m = {k: v["value"] for k, v in r["metrics"].items()}
        assert m["output_sequence_length"] == m["usage_completion_tokens"] == OUTPUT  # its count and ours
        assert m["usage_completion_tokens_diff_pct"] == 0.0
        assert m["time_to_first_token"] > 0 and m["inter_token_latency"] > 0
        messages = sent[r["metadata"]["conversation_id"]]["messages"]
        want = tok.encode_chat([{"role": x["role"], "content": _text(x["content"])} for x in messages])
        assert m["usage_prompt_tokens"] == len(want)  # the template's default system turn included
        assert m["usage_prompt_cache_read_tokens"] % PAGE == 0 and m["usage_prompt_cache_read_tokens"] < len(want)


def test_guidellm_runs_unchanged_and_reports_what_was_served(deployment: Launch, smollm2_dir: Path, tmp_path) -> None:
    """guidellm always asks for vLLM's ``continuous_usage_stats`` and ``max_completion_tokens``, and sends
    message content as a list of parts: all served."""
    report = tmp_path / "guidellm.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": _target(deployment), "model": "smollm2", "api_key": KEY,
                    "request_format": "/v1/chat/completions"},
        "profile": {"kind": "concurrent", "streams": [2]},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT, "output_tokens": OUTPUT}],
        "tokenizer": {"kind": "hf_auto", "model": str(smollm2_dir)},
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}  # fmt: skip
    config = tmp_path / "scenario.json"
    config.write_text(json.dumps(scenario))
    _run([str(tool("guidellm")), "run", "-c", str(config), "--disable-console-interactive"], tmp_path)
    (bench,) = json.loads(report.read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                  "total": REQUESTS}  # fmt: skip
    tok = Tokenizer(smollm2_dir)
    cached = 0
    for r in bench["requests"]["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] and body["stream_options"]["continuous_usage_stats"]
        want = tok.encode_chat([{"role": m["role"], "content": _text(m["content"])} for m in body["messages"]])
        assert r["prompt_tokens"] == len(want) and r["output_tokens"] == OUTPUT
        assert r["time_to_first_token_ms"] > 0 and r["inter_token_latency_ms"] > 0
        assert r["cached_tokens"] % PAGE == 0 and r["cached_tokens"] < len(want)
        cached += r["cached_tokens"]
    assert cached > 0  # the chat template's system turn fills a page every prompt shares

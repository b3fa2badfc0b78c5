"""A real deployment across three emulated hosts (network namespaces on a bridge): prefill groups on
hosts 0 and 1, the decode group on host 2; mpirun starts the ranks through ``scripts/netns_agent.sh``
(as it would through ssh), every rank binds and advertises its host's address, MPI and UCX use the
hosts' one interface, UCX is forced onto TCP. The launcher and the client run on host 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import prompt_of, tiny_engine
from tests.netns import EmulatedHosts, available
from torch_engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no emulated hosts: {WHY}")
PROMPTS = [prompt_of(n, 40 + n) for n in (3, 9, 17, 26, 33, 41, 52, 60)]


def deploy_across(
    hosts: EmulatedHosts, tmp: Path, prefill: dict, decode: dict, max_tokens: int = 8, kill: str | None = None
) -> dict:
    cfg = {
        "mode": "disaggregated",
        "hosts": [{"name": n, "address": a} for n, a in zip(hosts.names, hosts.addresses, strict=True)],
        "prefill": prefill,
        "decode": decode,
        "page_size": 4,
        "run_dtype": "float32",
        "network": {"interface": "eth0", "launch_agent": str(REPO / "scripts/netns_agent.sh"),
                    "ucx_transports": "tcp,self"},
        "timeouts": {"startup_s": 240, "kv_transfer_s": 60, "shutdown_s": 20},
        "router": {"enabled": False},
        "run_dir": str(tmp / "run"),
        "engine_cache": str(tmp / "engines"),
    }  # fmt: skip
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    (tmp / "prompts.json").write_text(json.dumps(PROMPTS), encoding="utf-8")
    head = hosts.names[2]
    script = (f"hostname {head}; exec {sys.executable} -m tests.emulated_deploy {tmp / 'cluster.yaml'} "
              f"{tmp / 'prompts.json'} {tmp / 'out.json'} --max-tokens {max_tokens}"
              + (f" --kill {kill}" if kill else ""))  # fmt: skip
    argv = hosts.run(2, ["unshare", "--uts", "sh", "-c", script])
    try:
        done = subprocess.run(argv, check=False, cwd=REPO, timeout=300, capture_output=True, text=True)
    finally:  # whatever happened, nothing of the run outlives the test (every rank's command line names run_dir)
        subprocess.run(["pkill", "-9", "-f", str(tmp / "run")], check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def test_two_prefill_hosts_and_a_decode_host(tiny_engine_dir, tmp_path: Path) -> None:
    engine = str(tiny_engine_dir("llama"))
    with EmulatedHosts(3) as hosts:
        before = hosts.rx_bytes(2)
        out = deploy_across(
            hosts, tmp_path,
            prefill={"count": 2, "engine_dir": engine, "num_pages": 256, "hosts": [hosts.names[0], hosts.names[1]]},
            decode={"count": 1, "engine_dir": engine, "num_pages": 256, "hosts": [hosts.names[2]]},
        )  # fmt: skip
        received = hosts.rx_bytes(2) - before
        leaders = out["leaders"]
    assert out["errors"] == [None] * len(PROMPTS), out["errors"]
    ref = tiny_engine(tiny_engine_dir("llama"))
    want = ref.generate(PROMPTS, SamplingParams(max_tokens=8))
    assert out["tokens"] == want
    assert leaders == {"decode0.tp0": hosts.addresses[2], "prefill0.tp0": hosts.addresses[0],
                       "prefill1.tp0": hosts.addresses[1]}  # fmt: skip
    # the KV of every prompt (whole pages of tokens [0, n-1), every layer) reached host 2 over its interface
    spec = ref.kv_export().spec
    pages = sum(-(-(len(p) - 1) // spec.page_size) for p in PROMPTS)
    kv = pages * spec.page_bytes * spec.num_layers
    assert received >= kv, (received, kv)
    assert out["left"] == 0


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_prefill_tp2_on_one_host_decode_tp1_on_another(kind: str, tiny_engine_dir, tmp_path: Path) -> None:
    with EmulatedHosts(3) as hosts:
        out = deploy_across(
            hosts, tmp_path,
            prefill={"count": 1, "tp": 2, "engine_dir": str(tiny_engine_dir(kind, 2)), "num_pages": 256,
                     "hosts": [hosts.names[0]]},
            decode={"count": 1, "engine_dir": str(tiny_engine_dir(kind, 1)), "num_pages": 256,
                    "hosts": [hosts.names[2]]},
        )  # fmt: skip
    assert out["errors"] == [None] * len(PROMPTS), out["errors"]
    assert out["tokens"] == tiny_engine(tiny_engine_dir(kind)).generate(PROMPTS, SamplingParams(max_tokens=8))
    assert out["left"] == 0


def test_a_prefill_group_killed_on_another_host_is_restarted(tiny_engine_dir, tmp_path: Path) -> None:
    """Every process of host 1's prefill group killed mid-load: no request hangs (each completes
    with the plain tokens or ends with a clear error), the deployment keeps serving through host 0's
    group, host 1's group is restarted there, serves again, and the supervisor's log names what died
    (from mpirun's own report: the launcher cannot see another host's processes) and what restarted."""
    engine = str(tiny_engine_dir("llama"))
    with EmulatedHosts(3) as hosts:
        out = deploy_across(
            hosts, tmp_path,
            prefill={"count": 2, "engine_dir": engine, "hosts": [hosts.names[0], hosts.names[1]]},
            decode={"count": 1, "engine_dir": engine, "hosts": [hosts.names[2]]},
            kill="prefill1", max_tokens=12,
        )  # fmt: skip
        host = hosts.names[1]
    want = tiny_engine(tiny_engine_dir("llama")).generate(PROMPTS, SamplingParams(max_tokens=12))
    events = "\n".join(out["events"])
    print(events)
    assert out["killed"] >= 1
    assert len(out["load_tokens"]) == 3 * len(PROMPTS)
    for tokens, error, w in zip(out["load_tokens"], out["load_errors"], want * 3, strict=True):
        assert tokens == w if error is None else "prefill" in error or "KV" in error, error
    assert "prefill group 1 TP rank 0" in events and host in events and "died" in events, events
    assert "prefill1 restarted (generation 1)" in events, events
    assert out["named_after_s"] < 30
    assert out["again_tokens"] == want
    assert out["served_again"] > 0
    assert out["left"] == 0

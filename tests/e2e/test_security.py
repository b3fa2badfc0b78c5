"""A locked-down deployment (``security.restrict``; on by default off loopback): Triton's model
repository and inference protocols on every node answer only calls that carry the deployment's key,
which its own callers (decode -> prefill, the router -> decode) send; a client without it can neither
generate on a decode node nor stop another client's request there."""

from __future__ import annotations

import ipaddress
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kv_messenger.protocol import PrefillRequest
from orchestrator.launch import Launch, run_processes
from serving.names import Model, Tensor
from serving.node_config import AUTH_HEADER, GRPC_AUTH_HEADER
from tests.deploy_harness import cluster, deployed, grpc_url, listening, run_ids
from tests.helpers import prompt_of, tiny_engine
from torch_engine.config import Role
from torch_engine.sampling import SamplingParams


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = [x for x in r.read().decode().splitlines() if x.startswith(name)]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def test_restricted_protocols_need_the_deployment_key(tiny_engine_dir, tmp_path: Path) -> None:
    engine_dir = tiny_engine_dir("llama")
    group = {"count": 1, "tp": 1, "engine_dir": str(engine_dir), "num_pages": 64}
    cfg = cluster(tmp_path, mode="disaggregated", prefill=group, decode=group, page_size=4,
                  security={"restrict": "on"})  # fmt: skip
    prompts = [prompt_of(n, n) for n in (5, 17, 33)]
    with deployed(cfg) as launch:
        assert launch.prepared is not None and launch.auth_key is not None
        got = run_ids(grpc_url(launch), prompts, 6, key=launch.auth_key)  # its prefill calls carry the key too
        assert [c.token_ids for c in got] == tiny_engine(engine_dir).generate(prompts, SamplingParams(max_tokens=6))
        secret = launch.run_dir / "secret"
        assert secret.read_text().strip() == launch.auth_key and stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert stat.S_IMODE((launch.run_dir / "launch.sh").stat().st_mode) == 0o700
        decode = next(ld for ld in launch.prepared.leaders if ld.slot.role is Role.DECODE)
        prefill = next(ld for ld in launch.prepared.leaders if ld.slot.role is Role.PREFILL)
        _model_control_refused(decode.ports.grpc, decode.ports.http, decode.models[0], launch.auth_key)
        _model_control_refused(prefill.ports.grpc, prefill.ports.http, Model.PREFILL, launch.auth_key)
        _prefill_request_refused(launch, prefill.ports.grpc, prefill.ports.metrics)
        _decode_inference_refused(grpc_url(launch))
        again = run_ids(grpc_url(launch), prompts[:1], 6, key=launch.auth_key)  # still serving
        ranks = list(run_processes(launch.run_id))
        exposed = [(pid, a, port) for pid, a, port in listening(ranks) if not loopback(a)]
        assert not exposed, f"bound to loopback, yet listening on another address: {exposed}"  # MPI, UCX, Triton
        assert again[0].token_ids == got[0].token_ids


def _model_control_refused(grpc_port: int, http_port: int, model: str, key: str) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        with pytest.raises(InferenceServerException, match=r"(?i)restricted|unauthorized|permission"):
            client.unload_model(model)
        with pytest.raises(InferenceServerException):
            client.unload_model(model, headers={GRPC_AUTH_HEADER: "wrong"})
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/models/{model}/unload", b"{}")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(req, timeout=10)
        keyed = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", b"{}", {AUTH_HEADER: key})
        with urllib.request.urlopen(keyed, timeout=10) as r:  # HTTP takes the header as it is
            assert r.status == 200
        assert client.is_model_ready(model)  # nothing was unloaded
        index = client.get_model_repository_index(headers={GRPC_AUTH_HEADER: key})  # the key opens it
        assert any(m.name == model for m in index.models)
    finally:
        client.close()


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _decode_inference_refused(url: str) -> None:
    """Without the key, or with a wrong one, a client can neither generate on the decode node (the
    ``llm`` ensemble, ``decode``) nor ``stop`` live requests there by guessing their ids: Triton
    refuses the call before it reaches a model (the inference protocol is restricted)."""
    client = grpcclient.InferenceServerClient(url)
    stop = grpcclient.InferInput(Tensor.STOP, [1], "BOOL")
    stop.set_data_from_numpy(np.array([True]))
    text = grpcclient.InferInput(Tensor.TEXT_INPUT, [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    try:
        for headers in (None, {GRPC_AUTH_HEADER: "wrong"}):
            for model, inputs in ((Model.DECODE, [stop]), (Model.LLM, [text])):
                with pytest.raises(InferenceServerException, match=r"(?i)restricted|unauthorized|permission"):
                    client.infer(model, inputs, request_id="r0", headers=headers)
    finally:
        client.close()


def _prefill_request_refused(launch: Launch, grpc_port: int, metrics_port: int) -> None:
    """A prefill request from outside (no key) would make the node write into decode pages: refused
    before it reaches the model; the node sent no byte."""
    sent = _metric(metrics_port, "disagg_kv_transfer_bytes_total")
    req = PrefillRequest(request_id="intruder", epoch=0, prompt_ids=prompt_of(12, 1), dst_pages=[0, 1, 2],
                         decode_ranks=[f"{launch.run_id}-decode0.tp0"])  # fmt: skip
    inp = grpcclient.InferInput(Tensor.PREFILL_REQUEST, [1], "BYTES")
    inp.set_data_from_numpy(np.array([req.model_dump_json().encode()], dtype=np.object_))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        with pytest.raises(InferenceServerException, match=r"(?i)restricted|unauthorized|permission"):
            client.infer(Model.PREFILL, [inp])
    finally:
        client.close()
    assert _metric(metrics_port, "disagg_kv_transfer_bytes_total") == sent
    deadline = time.monotonic() + 10
    while _metric(metrics_port, "disagg_live_records") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(metrics_port, "disagg_live_records") == 0  # the intruder's request left no trace

"""A locked-down deployment (``security.restrict``; on by default off loopback): no node has model
control, and every node answers inference only to calls that carry the deployment's key, which its own
callers (decode -> prefill, the router -> decode) send; a client without it can neither generate on a
decode node nor stop another client's request there; the key is on no command line."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import queue
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
from serving.ports import free_port
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
        _decode_inference_refused(grpc_url(launch), decode.models)
        _no_secret_in_sight(launch, launch.auth_key)
        again = run_ids(grpc_url(launch), prompts[:1], 6, key=launch.auth_key)  # still serving
        ranks = list(run_processes(launch.run_id))
        exposed = [(pid, a, port) for pid, a, port in listening(ranks) if not loopback(a)]
        assert not exposed, f"bound to loopback, yet listening on another address: {exposed}"  # MPI, UCX, Triton
        assert again[0].token_ids == got[0].token_ids


def _model_control_refused(grpc_port: int, http_port: int, model: str, key: str) -> None:
    """A locked node has no model control: load, unload and the repository index are refused with the
    key or without it, and the model stays loaded."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        for headers in (None, {GRPC_AUTH_HEADER: "wrong"}, {GRPC_AUTH_HEADER: key}):
            with pytest.raises(InferenceServerException):
                client.unload_model(model, headers=headers)
            with pytest.raises(InferenceServerException):
                client.load_model(model, headers=headers)
        for headers in ({}, {AUTH_HEADER: key}):
            req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/models/{model}/unload", b"{}",
                                         headers)  # fmt: skip
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(req, timeout=10)
        assert client.is_model_ready(model)  # nothing was unloaded
    finally:
        client.close()


def _no_secret_in_sight(launch: Launch, key: str) -> None:
    """The key is on no process's command line (``/proc/<pid>/cmdline`` is readable by every local
    user) and in no rendered script; the files that hold it are the owner's alone."""
    for pid in run_processes(launch.run_id):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    for script in launch.run_dir.glob("*.sh"):
        assert key not in script.read_text(), script
    for held in (launch.run_dir / "secret", *(launch.run_dir / "nodes").glob("*.yaml")):
        assert stat.S_IMODE(held.stat().st_mode) & 0o077 == 0, held


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _decode_inference_refused(url: str, served: tuple[str, ...]) -> None:
    """Without the key, or with a wrong one, a client can neither generate on the decode node (the
    ``llm`` ensemble, ``decode``) nor ``stop`` live requests there by guessing their ids: the node refuses
    the request before it does anything (``serving.auth``: Triton forwards the key's header)."""
    stop = grpcclient.InferInput(Tensor.STOP, [1], "BOOL")
    stop.set_data_from_numpy(np.array([True]))
    text = grpcclient.InferInput(Tensor.TEXT_INPUT, [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    for headers in (None, {GRPC_AUTH_HEADER: "wrong"}):
        for model, inputs in ((Model.DECODE, [stop]), (Model.LLM, [text])):
            if model not in served and model is not Model.DECODE:  # a tokenizer-less engine serves ids on decode
                continue
            got: queue.Queue[object] = queue.Queue()
            client = grpcclient.InferenceServerClient(url)
            try:
                client.start_stream(callback=lambda result, error, out=got: out.put(error or result), headers=headers)
                client.async_stream_infer(model, inputs, request_id="r0")
                first = got.get(timeout=30)
            finally:
                client.stop_stream()
                client.close()
            assert isinstance(first, InferenceServerException) and "unauthorized" in str(first), (model, first)


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


def test_a_locked_deployment_serves_every_client_facing_model_with_the_key(smollm2_dir: Path, tmp_path: Path) -> None:
    """SmolLM2 locked down behind the router: the router's calls carry the key; TensorRT-LLM's ``ensemble``
    (whose BLS call to ``llm`` passes the key on) and the ``llm`` ensemble (whose steps get the forwarded
    key) answer a client that sends it and refuse one that does not."""
    group = {"count": 1, "tp": 1, "engine_dir": str(smollm2_dir), "num_pages": 128}
    router = {"enabled": True, "port": free_port(), "api_key": "router-key"}
    cfg = cluster(
        tmp_path, mode="colocated", prefill={"count": 0}, decode=group, security={"restrict": "on"}, router=router
    )
    with deployed(cfg) as launch:
        assert launch.prepared is not None and launch.prepared.router_url is not None and launch.auth_key
        body = json.dumps({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4}).encode()
        auth = {"Authorization": "Bearer router-key", "Content-Type": "application/json"}
        req = urllib.request.Request(f"{launch.prepared.router_url}/completions", body, auth)
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        url = grpc_url(launch)
        prompt = np.array([[b"The capital of France is"]], dtype=np.object_)
        batched = {Tensor.TEXT_INPUT: prompt, "max_tokens": np.array([[4]], dtype=np.int32)}
        plain = {Tensor.TEXT_INPUT: prompt[0], "max_tokens": np.array([4], dtype=np.int32)}
        for model, inputs in ((Model.ENSEMBLE, batched), (Model.LLM, plain)):
            text, error = _stream(url, model, inputs, {GRPC_AUTH_HEADER: launch.auth_key})
            assert error is None and text, (model, error)
            _, refused = _stream(url, model, inputs, None)
            assert refused is not None and "unauthorized" in refused, (model, refused)
        _no_secret_in_sight(launch, launch.auth_key)


def _stream(
    url: str, model: str, inputs: dict[str, np.ndarray], headers: dict[str, str] | None
) -> tuple[str, str | None]:
    """(the text, the first error) of one streamed request."""
    kinds = {"object": "BYTES", "int32": "INT32"}
    tensors = []
    for name, arr in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), kinds[str(arr.dtype)])
        t.set_data_from_numpy(arr)
        tensors.append(t)
    got: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    text: list[str] = []
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                return "".join(text), str(error)
            assert isinstance(result, grpcclient.InferResult)
            out = result.as_numpy(Tensor.TEXT_OUTPUT)
            if out is not None:
                text += [x.decode() for x in out.reshape(-1)]
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "".join(text), None
    finally:
        client.stop_stream()
        client.close()


def test_a_tp_group_bound_to_loopback_listens_on_loopback_only(tiny_engine_dir, tmp_path: Path) -> None:
    """TP 2 groups (their torch.distributed rendezvous and gloo pairs, the KV messenger's UCX, MPI) on a
    deployment bound to loopback: every socket any of its processes listens on is a loopback one."""
    engine_dir = tiny_engine_dir("llama", 2)
    group = {"count": 1, "tp": 2, "engine_dir": str(engine_dir), "num_pages": 64}
    cfg = cluster(tmp_path, mode="disaggregated", prefill=group, decode=group, page_size=4)
    with deployed(cfg) as launch:
        got = run_ids(grpc_url(launch), [prompt_of(9, 3)], 4)
        assert got[0].token_ids
        ranks = [p for p in run_processes(launch.run_id) if "prterun" not in Path(f"/proc/{p}/cmdline").read_text()]
        exposed = [(pid, a, port) for pid, a, port in listening(ranks) if not loopback(a)]
        assert not exposed, f"bound to loopback, yet listening on another address: {exposed}"

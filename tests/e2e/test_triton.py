"""End to end through a real tritonserver on 127.0.0.1: HTTP generate, HTTP SSE, gRPC streaming, bad input."""

from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from orchestrator.triton import SHM_DIR, Ports, TritonError, TritonInstall, TritonServer
from tests.helpers import metric, settled_metric
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    run = tmp_path_factory.mktemp("triton")
    node = run / "node.yaml"
    node.write_text(
        f"engine: {{engine_dir: {smollm2_dir}, num_pages: 256, num_threads: 2}}\nlimits: {{max_tokens: 64}}\n",
        encoding="utf-8",
    )
    srv = TritonServer(ROOT / "model_repo", run / "run", node, Ports.free())
    srv.start()
    assert list(SHM_DIR.glob(f"{srv.shm_prefix}*"))  # the stubs' shared memory carries the server's prefix
    yield srv
    assert srv.stop() == 0, srv.log_tail()
    assert not list(SHM_DIR.glob(f"{srv.shm_prefix}*"))


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> str:
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=64))
    ids = engine.generate([PROMPT], SamplingParams(max_tokens=12))[0]
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(ids)


def http_generate(srv: TritonServer, body: dict, stream: bool = False) -> tuple[int, str]:
    path = "generate_stream" if stream else "generate"
    req = urllib.request.Request(
        f"http://{srv.http_url}/v2/models/llm/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def infer_inputs(inputs: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    kinds = {"object": "BYTES", "int32": "INT32", "float32": "FP32", "bool": "BOOL", "uint64": "UINT64"}
    tensors = []
    for name, arr in inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), kinds[str(arr.dtype)])
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def grpc_stream(
    srv: TritonServer,
    inputs: dict[str, np.ndarray],
    model: str = "llm",
    extra: dict[str, list[np.ndarray]] | None = None,
) -> tuple[list[str], list[str]]:
    """(text pieces, errors) of one streamed request; ``extra``: output name -> where to collect it."""
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, infer_inputs(inputs), enable_empty_final_response=True)
    pieces, errors = [], []
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            errors.append(str(error))
            break
        out = result.as_numpy("text_output")
        if out is not None:
            pieces += [x.decode() for x in out.reshape(-1)]
        for name, got in (extra or {}).items():
            if result.as_numpy(name) is not None:
                got.append(result.as_numpy(name))
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return pieces, errors


def test_http_generate_equals_engine(server: TritonServer, reference: str) -> None:
    status, body = http_generate(server, {"text_input": PROMPT, "max_tokens": 12})
    assert status == 200, body
    assert json.loads(body)["text_output"] == reference


def test_http_sse_stream_equals_engine(server: TritonServer, reference: str) -> None:
    status, body = http_generate(server, {"text_input": PROMPT, "max_tokens": 12, "stream": True}, stream=True)
    assert status == 200, body
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1  # really streamed
    assert "".join(e["text_output"] for e in events) == reference


def test_grpc_stream_equals_engine(server: TritonServer, reference: str) -> None:
    pieces, errors = grpc_stream(
        server,
        {
            "text_input": np.array([PROMPT.encode()], dtype=np.object_),
            "max_tokens": np.array([12], dtype=np.int32),
            "stream": np.array([True]),
        },
    )
    assert not errors
    assert len(pieces) > 1 and "".join(pieces) == reference


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"max_tokens": 4}, "input text_input is missing"),
        ({"text_input": "   ", "max_tokens": 4}, "input text_input is empty"),
        ({"text_input": "hi", "max_tokens": 0}, r"max_tokens must be in \[1, 64\], got 0"),
        ({"text_input": "hi", "max_tokens": 65}, r"max_tokens must be in \[1, 64\], got 65"),
        ({"text_input": "hi", "max_tokens": 4, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature must be >= 0"),
        ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, "beam_width 2 is not supported"),
        ({"text_input": "hi " * 9000, "max_tokens": 4}, "the context holds 8192"),
        ({"text_input": "hi", "max_tokens": 4, "num_return_sequences": 2}, "num_return_sequences 2 is not supported"),
    ],
)
def test_bad_input_gets_an_error_and_the_server_keeps_serving(
    server: TritonServer, reference: str, body, match
) -> None:
    import re

    status, text = http_generate(server, body)
    assert status == 400, text
    assert re.search(match, json.loads(text)["error"]), text
    status, text = http_generate(server, {"text_input": PROMPT, "max_tokens": 12})
    assert status == 200 and json.loads(text)["text_output"] == reference


def trtllm_inputs(prompt: str, stream: bool, **extra: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs as TensorRT-LLM's end-to-end gRPC client shapes them (a batch dimension, its default extras)."""
    return {
        "text_input": np.array([[prompt.encode()]], dtype=np.object_),
        "max_tokens": np.array([[12]], dtype=np.int32),
        "stream": np.array([[stream]]),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "exclude_input_in_output": np.array([[False]]),
        "pad_id": np.array([[2]], dtype=np.int32),
        "top_k": np.array([[1]], dtype=np.int32),  # greedy, as temperature 1 alone would sample
    } | extra


def test_tensorrt_llm_shaped_requests_on_ensemble(server: TritonServer, reference: str) -> None:
    pieces, errors = grpc_stream(server, trtllm_inputs(PROMPT, stream=True), model="ensemble")
    assert not errors and len(pieces) > 1 and "".join(pieces) == reference  # streamed: new text only
    pieces, errors = grpc_stream(server, trtllm_inputs(PROMPT, stream=False), model="ensemble")
    assert not errors and pieces == [PROMPT + reference]  # exclude_input_in_output false: the prompt first
    logprobs: list[np.ndarray] = []
    cumulative: list[np.ndarray] = []
    pieces, errors = grpc_stream(
        server,
        trtllm_inputs(PROMPT, stream=True, return_log_probs=np.array([[True]])),
        model="ensemble",
        extra={"output_log_probs": logprobs, "cum_log_probs": cumulative},
    )
    assert not errors and "".join(pieces) == reference
    assert all(lp.shape[0] == 1 for lp in logprobs) and all(c.shape == (1, 1) for c in cumulative)
    every = np.concatenate([lp.reshape(-1) for lp in logprobs])
    assert len(every) == 12 and (every <= 0).all()
    assert cumulative[-1][0, 0] == pytest.approx(float(every.sum()), abs=1e-4)
    _, errors = grpc_stream(server, trtllm_inputs(PROMPT, stream=True) | {"pad_id": np.array([[2], [2]], np.int32)})
    assert errors and "pad_id" in errors[0]  # `llm` has no batch dimension (and no pad_id)
    two = {"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}
    _, errors = grpc_stream(server, trtllm_inputs(PROMPT, stream=True) | two, model="ensemble")
    assert errors and "batch" in errors[0]


def test_llm_echoes_the_prompt_without_streaming(server: TritonServer, reference: str) -> None:
    body = {"text_input": PROMPT, "max_tokens": 12, "exclude_input_in_output": False}
    status, text = http_generate(server, body)
    assert status == 200 and json.loads(text)["text_output"] == PROMPT + reference


def test_wrong_dtype_shape_and_invalid_utf8_over_grpc(server: TritonServer) -> None:
    _, errors = grpc_stream(
        server, {"text_input": np.array([b"hi"], dtype=np.object_), "max_tokens": np.array([4.0], dtype=np.float32)}
    )
    assert errors and "max_tokens" in errors[0]
    _, errors = grpc_stream(server, {"text_input": np.array([b"\xff\xfe broken"], dtype=np.object_)})
    assert errors and "not valid UTF-8" in errors[0]
    _, errors = grpc_stream(server, {"text_input": np.array([b"one", b"two"], dtype=np.object_)})  # wrong shape
    assert errors and "text_input" in errors[0]


def test_port_in_use_and_missing_binary(server: TritonServer, tmp_path: Path) -> None:
    busy = Ports(server.ports.http, server.ports.grpc + 0, server.ports.metrics)
    with pytest.raises(TritonError, match=r"http port 127\.0\.0\.1:\d+ is already in use"):
        TritonServer(ROOT / "model_repo", tmp_path / "x", tmp_path / "node.yaml", busy).start()
    install = TritonInstall.find()
    broken = TritonInstall(tmp_path / "nope", install.libs, install.python_backend, install.stub)
    with pytest.raises((TritonError, FileNotFoundError)):
        TritonServer(ROOT / "model_repo", tmp_path / "y", tmp_path / "node.yaml", Ports.free(), install=broken).start()


def test_metrics_are_published(server: TritonServer) -> None:
    assert http_generate(server, {"text_input": PROMPT, "max_tokens": 5})[0] == 200
    assert settled_metric(server, "disagg_time_to_first_token_seconds_count") >= 1
    assert settled_metric(server, "disagg_inter_token_latency_seconds_count") >= 4
    assert settled_metric(server, "disagg_generation_tokens_total") >= 5
    assert settled_metric(server, "disagg_prompt_tokens_total") >= 5
    assert metric(server, "disagg_kv_pages", 'state="used"') == 0  # everything finished: pages back
    assert metric(server, "disagg_kv_pages", 'state="free"') == 256
    assert metric(server, "disagg_queue_depth", 'queue="running"') == 0


def test_client_cancel_aborts_and_frees_pages(server: TritonServer) -> None:
    import time

    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Write a long story about a dragon."], dtype=np.object_))
    n = grpcclient.InferInput("max_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([64], dtype=np.int32))
    s = grpcclient.InferInput("stream", [1], "BOOL")
    s.set_data_from_numpy(np.array([True]))
    client.async_stream_infer("llm", [text, n, s])
    got.get(timeout=120)  # the first token arrived: the request holds pages now
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 30
    while metric(server, "disagg_kv_pages", 'state="used"') != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "disagg_kv_pages", 'state="used"') == 0
    assert metric(server, "disagg_queue_depth", 'queue="running"') == 0
    status, _ = http_generate(server, {"text_input": PROMPT, "max_tokens": 4})
    assert status == 200


def test_cancelling_an_ensemble_request_stops_it_on_the_decode_model(server: TritonServer) -> None:
    """The BLS call inside `ensemble` cannot be cancelled in this Triton: a `stop` request does it."""
    import time

    generated = settled_metric(server, "disagg_generation_tokens_total")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inputs = trtllm_inputs("Write a long story about a dragon.", stream=True)
    inputs["max_tokens"] = np.array([[64]], dtype=np.int32)
    inputs["ignore_eos"] = np.array([[True]])
    client.async_stream_infer("ensemble", infer_inputs(inputs), request_id="cancel-me")
    got.get(timeout=120)  # the first piece arrived
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 30
    while metric(server, "disagg_queue_depth", 'queue="running"') != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "disagg_kv_pages", 'state="used"') == 0
    assert settled_metric(server, "disagg_generation_tokens_total") - generated < 64  # stopped, not run to max_tokens
    pieces, errors = grpc_stream(server, trtllm_inputs(PROMPT, stream=True), model="ensemble")
    assert not errors and pieces  # the node keeps serving


def test_a_stop_request_needs_a_request_id(server: TritonServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stop = grpcclient.InferInput("stop", [1], "BOOL")
    stop.set_data_from_numpy(np.array([True]))
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("decode", [stop])
    _, error = got.get(timeout=60)
    client.stop_stream()
    client.close()
    assert error is not None and "request id" in str(error)


def test_perf_analyzer_streaming_run(server: TritonServer, tmp_path: Path) -> None:
    import subprocess
    import sys

    from orchestrator.triton import perf_analyzer_env

    data = {"data": [{"text_input": [PROMPT], "max_tokens": [8], "stream": [True]}]}
    (tmp_path / "input.json").write_text(json.dumps(data), encoding="utf-8")
    cmd = [str(Path(sys.executable).parent / "perf_analyzer"), "-m", "llm", "-i", "grpc", "-u", server.grpc_url]
    cmd += ["--streaming", "--input-data", str(tmp_path / "input.json")]
    cmd += ["--measurement-mode", "count_windows", "--measurement-request-count", "3", "--concurrency-range", "1"]
    cmd += ["--stability-percentage", "1000", "--max-trials", "3"]  # a completed run, not a stable number: CI is noisy
    env = perf_analyzer_env(server.install, tmp_path / "libs")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Throughput" in done.stdout


def test_stop_words_cut_the_text(server: TritonServer, reference: str) -> None:
    stop = reference.split()[1]  # the second word of the greedy answer
    status, body = http_generate(server, {"text_input": PROMPT, "max_tokens": 12, "stop_words": [stop]})
    assert status == 200, body
    assert json.loads(body)["text_output"] == reference[: reference.index(stop)]


def test_guided_decoding_inputs_as_tensorrt_llm_clients_send_them(server: TritonServer) -> None:
    """TensorRT-LLM's ``guided_decoding_guide_type`` / ``guided_decoding_guide``: on ``ensemble`` with its
    shapes (gRPC), on ``llm`` through Triton's generate endpoint; a bad guide is an error naming it."""
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    guide = {
        "guided_decoding_guide_type": np.array([[b"regex"]], dtype=np.object_),
        "guided_decoding_guide": np.array([[phone.encode()]], dtype=np.object_),
        "max_tokens": np.array([[30]], dtype=np.int32),
    }
    pieces, errors = grpc_stream(server, trtllm_inputs("My phone number is", stream=False) | guide, model="ensemble")
    assert not errors and re.fullmatch(phone, pieces[0].removeprefix("My phone number is")), pieces
    body = {
        "text_input": "Describe a cat as JSON.", "max_tokens": 40, "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                             "required": ["name"], "additionalProperties": False}),
    }  # fmt: skip
    status, text = http_generate(server, body)
    assert status == 200 and set(json.loads(json.loads(text)["text_output"])) == {"name"}, text
    status, text = http_generate(server, body | {"guided_decoding_guide": "{nope"})
    assert status >= 400 and "invalid json_schema guide" in text
    status, text = http_generate(server, {"text_input": "x", "max_tokens": 2, "guided_decoding_guide_type": "xml"})
    assert status >= 400 and "guided_decoding_guide_type 'xml' is not supported" in text

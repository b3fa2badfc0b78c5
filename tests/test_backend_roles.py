"""The Triton backend shim without a server: each role driven through a mocked ``triton_python_backend_utils``
(as TensorRT-LLM's backend tests do), against real engines and tokenizers."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serving.names import OVERLOADED, BackendRole, Model, Tensor
from serving.node_config import NODE_CONFIG_ENV, NodeConfig, RequestLimits
from serving.prefill_client import refusal
from serving.wire import SIGNATURES
from torch_engine.config import EngineConfig, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

MODEL_PY = Path(__file__).resolve().parent.parent / "backends" / "disagg_backend" / "model.py"
FINAL = 1


class FakeTensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name, self.value = str(name), np.asarray(value)

    def as_numpy(self) -> np.ndarray:
        return self.value


class FakeError:
    def __init__(self, message: str) -> None:
        self.message = message


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor] | None = None, error: FakeError | None = None) -> None:
        self.tensors = {t.name: t.value for t in output_tensors or []}
        self.error = error


class FakeMetric:
    def __init__(self, **_: object) -> None:
        self.values: list[float] = []
        self.threads: set[str] = set()  # the threads that recorded a value (each call is a round trip in Triton)

    def observe(self, v: float) -> None:
        self.values.append(v)
        self.threads.add(threading.current_thread().name)

    increment = set = observe


class FakeFamily:
    HISTOGRAM, COUNTER, GAUGE = 0, 1, 2

    def __init__(self, *_: object) -> None:
        pass

    def Metric(self, **kw: object) -> FakeMetric:
        return FakeMetric(**kw)


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse | None, int]] = []
        self.done = threading.Event()
        self.cancelled = False
        self.asked_by: set[str] = set()  # the threads that asked whether the client went away

    def send(self, response: FakeResponse | None = None, flags: int = 0) -> None:
        self.sent.append((response, flags))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        self.asked_by.add(threading.current_thread().name)
        return self.cancelled


class FakeRequest:
    def __init__(self, inputs: dict[str, np.ndarray], request_id: str = "", outputs: tuple[str, ...] = ()) -> None:
        self.inputs, self._id, self.sender = inputs, request_id, FakeSender()
        self.outputs = outputs or tuple(p.tensor.value for p in SIGNATURES[Model.DECODE].outputs)  # Triton: all

    def requested_output_names(self) -> list[str]:
        return list(self.outputs)

    def request_id(self) -> str:
        return self._id

    def get_response_sender(self) -> FakeSender:
        return self.sender


def _fake_pb_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor = FakeTensor  # type: ignore[attr-defined]
    m.InferenceResponse = FakeResponse  # type: ignore[attr-defined]
    m.TritonError = FakeError  # type: ignore[attr-defined]
    m.MetricFamily = FakeFamily  # type: ignore[attr-defined]
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL  # type: ignore[attr-defined]

    def get_input_tensor_by_name(request: FakeRequest, name: str) -> FakeTensor | None:
        value = request.inputs.get(str(name))
        return None if value is None else FakeTensor(name, value)

    m.get_input_tensor_by_name = get_input_tensor_by_name  # type: ignore[attr-defined]
    return m


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location("disagg_backend_model_under_test", MODEL_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module


def _model(backend: Any, role: BackendRole, node: NodeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    path = tmp_path / f"{role.value}.yaml"
    node.dump(path)
    monkeypatch.setenv(NODE_CONFIG_ENV, str(path))
    model = backend.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {"role": {"string_value": role.value}}})})
    return model


def _strings(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def test_preprocessing_role_and_the_text_decode_answers(backend, smollm2_dir: Path, tmp_path, monkeypatch) -> None:
    """``llm`` is preprocessing -> decode: decode answers ``text_output`` (the engine loop's text, cut at a
    stop string) and only the outputs a caller asks for."""
    node = NodeConfig(engine=EngineConfig(engine_dir=smollm2_dir))
    pre = _model(backend, BackendRole.PREPROCESSING, node, tmp_path, monkeypatch)
    ok, empty, missing = pre.execute(
        [FakeRequest({"text_input": _strings("Hello there")}), FakeRequest({"text_input": _strings("  ")}),
         FakeRequest({})]
    )  # fmt: skip
    ids = ok.tensors[Tensor.INPUT_IDS].tolist()
    assert ids and ok.error is None
    assert empty.error.message == "input text_input is empty"
    assert missing.error.message == "input text_input is missing"
    decode = _model(backend, BackendRole.DECODE, node, tmp_path, monkeypatch)
    try:
        prompt = np.array(ids, np.int32)
        engine = LLMEngine(EngineConfig(engine_dir=smollm2_dir))
        out = engine.generate([ids], SamplingParams(max_tokens=12))[0]
        tok = engine.tokenizer
        assert tok is not None
        want = tok.decode(out)
        # a stop string: one generated token's text, first found where that token starts (the text ends there)
        stop = next(t for k in range(3, 12) if (t := tok.decode(out[k : k + 1])).strip()
                    and want.find(t) == len(tok.decode(out[:k])))  # fmt: skip
        llm = (Tensor.TEXT_OUTPUT.value, Tensor.OUTPUT_LOG_PROBS.value)
        calls = [
            FakeRequest(
                {"input_ids": prompt, "max_tokens": np.array([12], np.int32), "stream": np.array([s])}, outputs=llm
            )
            for s in (True, False)
        ] + [
            FakeRequest(
                {
                    "input_ids": prompt,
                    "max_tokens": np.array([12], np.int32),
                    "stream": np.array([True]),
                    "stop_words": _strings(stop),
                },
                outputs=llm,
            ),
            FakeRequest({"input_ids": prompt, "max_tokens": np.array([12], np.int32), "stream": np.array([True])}),
        ]
        decode.execute(calls)  # fmt: skip
        for c in calls:
            assert c.sender.done.wait(60)
        streamed, whole, stopped, everything = (
            [r for r, _ in c.sender.sent if r is not None and r.tensors] for c in calls
        )
        text = lambda rs: "".join(r.tensors[Tensor.TEXT_OUTPUT][0].decode() for r in rs)  # noqa: E731
        assert text(streamed) == text(whole) == want and len(streamed) > 1 and len(whole) == 1
        assert text(stopped) == want[: want.index(stop)]  # the stop string cut the text
        assert all(set(r.tensors) == set(llm) for r in streamed + whole + stopped)  # only what was asked for
        assert text(everything) == want and Tensor.OUTPUT_IDS.value in everything[0].tensors
    finally:
        decode.finalize()


def test_decode_role_streams_the_engines_tokens(backend, tiny_engine_dir, tmp_path, monkeypatch) -> None:
    engine_dir = tiny_engine_dir("llama")
    node = NodeConfig(engine=EngineConfig(engine_dir=engine_dir, num_pages=64))
    decode = _model(backend, BackendRole.DECODE, node, tmp_path, monkeypatch)
    try:
        prompt = [5, 9, 14, 3, 7]
        want = LLMEngine(EngineConfig(engine_dir=engine_dir), load_tokenizer=False).generate(
            [prompt], SamplingParams(max_tokens=6)
        )[0]
        ok = FakeRequest({"input_ids": np.array(prompt, np.int32), "max_tokens": np.array([6], np.int32),
                          "stream": np.array([False])}, request_id="same")  # fmt: skip
        again = FakeRequest(dict(ok.inputs), request_id="same")  # a client may reuse an id
        bad = FakeRequest({"input_ids": np.array(prompt, np.int32), "max_tokens": np.array([0], np.int32)})
        no_ids = FakeRequest({"max_tokens": np.array([6], np.int32)})
        decode.execute([ok, again, bad, no_ids])
        for r in (ok, again, bad, no_ids):
            assert r.sender.done.wait(30)
        (response, _), = no_ids.sender.sent  # fmt: skip
        assert response is not None and response.error is not None
        assert response.error.message == "input input_ids is missing"
        for r in (ok, again):
            (response, flags), = r.sender.sent  # fmt: skip
            assert response is not None and flags == FINAL and response.error is None
            assert response.tensors[Tensor.OUTPUT_IDS].tolist() == want
        (response, flags), = bad.sender.sent  # fmt: skip
        assert response is not None and response.error is not None
        assert "max_tokens must be in [1, 4096]" in response.error.message
        assert decode.role.loop.live() == 0  # nothing left behind
    finally:
        decode.finalize()


def test_decode_role_keeps_metrics_and_cancellation_checks_off_the_engine_thread(
    backend, smollm2_dir, tmp_path, monkeypatch
) -> None:
    """Recording a metric and asking a sender are round trips to Triton's server process: the engine
    thread makes none (they cost ~1 ms a step at batch 8 on a one-core node). The watch thread sends
    the per-token metrics (every token counted once) and aborts a cancelled stream; a gauge is sent a
    value only when it changed."""
    import time

    node = NodeConfig(engine=EngineConfig(engine_dir=smollm2_dir, num_pages=256))  # streams need the tokenizer's text
    decode = _model(backend, BackendRole.DECODE, node, tmp_path, monkeypatch)
    prompt = np.array([504, 3458, 314, 260, 1929], np.int32)

    def streamed(n: int) -> FakeRequest:
        return FakeRequest({"input_ids": prompt, "max_tokens": np.array([n], np.int32), "stream": np.array([True]),
                            "ignore_eos": np.array([True])})  # fmt: skip

    try:
        done, gone = streamed(12), streamed(2000)
        decode.execute([done, gone])
        deadline = time.monotonic() + 30
        while not gone.sender.sent and time.monotonic() < deadline:
            time.sleep(0.001)
        gone.sender.cancelled = True  # the client went away after its first piece
        assert done.sender.done.wait(30) and gone.sender.done.wait(30)
        assert gone.sender.sent[-1] == (None, FINAL) and len(gone.sender.sent) < 1000  # aborted, stream closed
        assert decode.role.loop.live() == 0
    finally:
        decode.finalize()  # sends what the watch thread had not sent yet
    m = decode.role.metrics
    loop_thread = decode.role.loop.name
    recorders = set().union(*(x.threads for x in (m.ttft, m.itl, m.generation_tokens, m.prompt_tokens)))
    assert recorders and loop_thread not in recorders
    assert loop_thread not in done.sender.asked_by | gone.sender.asked_by
    generated = sum(m.generation_tokens.values)
    assert generated >= 12 + 1 and len(m.ttft.values) == 2 and len(m.itl.values) == generated - 2
    assert sum(m.prompt_tokens.values) == len(prompt)  # of the finished request (the cancelled one is not)
    for gauge in (*m.pages.values(), *m.queue.values(), *m.records.values()):
        values = gauge.metric.values
        assert values and all(a != b for a, b in itertools.pairwise(values)), values


def test_prefill_role_refuses_bad_calls(backend, tiny_engine_dir, tmp_path, monkeypatch) -> None:
    node = NodeConfig(engine=EngineConfig(engine_dir=tiny_engine_dir("llama"), num_pages=16), agent_name="fake-pb")
    prefill = _model(backend, BackendRole.PREFILL, node, tmp_path, monkeypatch)
    try:
        neither, garbage, short = prefill.execute(
            [FakeRequest({}), FakeRequest({"prefill_request": _strings("{not json")}),
             FakeRequest({"prefill_request": _strings(json.dumps({
                 "request_id": "x", "epoch": 0, "prompt_ids": [1], "dst_pages": [0], "decode_ranks": ["d"]}))})]
        )  # fmt: skip
        assert neither.error.message == refusal("send handshake or prefill_request")  # the decoder need not fence
        assert "Invalid JSON" in garbage.error.message
        assert "needs at least 2 prompt tokens" in short.error.message
        assert prefill.role.loop.live() == 0
    finally:
        prefill.finalize()


class EnsembleRequest:
    """What the ``ensemble`` adapter reads of a request: its id, sender and tensors (none here)."""

    def __init__(self, request_id: str) -> None:
        self._id, self.sender = request_id, FakeSender()

    def request_id(self) -> str:
        return self._id

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def inputs(self) -> list[Any]:
        return []


def test_the_ensemble_adapter_sheds_what_the_node_could_not_hold(backend, tiny_engine_dir, tmp_path, monkeypatch):
    """One thread per ``ensemble`` request (its BLS call blocks), at most ``max_pending + max_num_seqs``
    of them: the next is refused at once as overloaded, and room comes back as requests end."""
    release = threading.Event()

    class BlockingBLS:
        def __init__(self, **_: object) -> None:
            pass

        def exec(self, decoupled: bool) -> Iterator[Any]:
            release.wait(30)
            return iter([])

    monkeypatch.setattr(backend.pb_utils, "InferenceRequest", BlockingBLS, raising=False)
    engine = EngineConfig(engine_dir=tiny_engine_dir("llama"), scheduler=SchedulerConfig(max_num_seqs=2))
    node = NodeConfig(engine=engine, limits=RequestLimits(max_pending=1))
    adapter = _model(backend, BackendRole.BATCH_ADAPTER, node, tmp_path, monkeypatch)
    held = [EnsembleRequest(f"r{i}") for i in range(3)]
    extra = EnsembleRequest("r3")
    adapter.execute([*held, extra])
    assert extra.sender.done.wait(5)
    ((response, flags),) = extra.sender.sent
    assert flags == FINAL and response is not None and response.error is not None
    assert response.error.message.startswith(OVERLOADED) and "max_pending + max_num_seqs" in response.error.message
    assert not any(r.sender.done.is_set() for r in held)
    release.set()
    for r in held:
        assert r.sender.done.wait(10) and r.sender.sent == [(None, FINAL)]
    again = EnsembleRequest("r4")
    adapter.execute([again])  # room came back
    assert again.sender.done.wait(10) and again.sender.sent == [(None, FINAL)]

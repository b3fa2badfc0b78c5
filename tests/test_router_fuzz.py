"""Nothing a client sends takes the router down: a fixed corpus of hostile bodies (each once broke
something: a 500 in plain text, a hang, a wrapped integer) and 2,000 fuzzed bodies (hypothesis: every
field of OpenAI's two endpoints with values of any JSON type, plus unknown fields and raw bytes)
against the real aiohttp app over a fake decode group. Every answer is below 500 and in OpenAI's
shape, none takes more than a few seconds, and the router serves a normal request afterwards. What
the fuzzer got past the router's validation then runs on the real SmolLM2 engine, beside a stream
that must keep the tokens it has alone."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend import generation
from frontend.config import GroupEndpoint, RouterConfig, RouterSpec
from frontend.server import Router
from frontend.upstream import Piece
from tests.router_harness import ScriptedPool
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason, RequestState
from torch_engine.sampling import InvalidRequestError, SamplingParams

PATHS = ("/v1/completions", "/v1/chat/completions")


ACCEPTED: list[tuple[list[int], SamplingParams]] = []  # what reached a decode group (the first 600)


async def short(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    """A decode group that answers at most three tokens (the prompt's last one, repeated)."""
    if len(ACCEPTED) < 600:
        ACCEPTED.append((list(ids), s))
    n = min(s.max_tokens, 3)
    for i in range(1, n + 1):
        yield Piece((ids[-1],) * i, i - 1, i, "length" if i == n else "")


class Client:
    """The router on its own event loop, for synchronous hypothesis tests."""

    def __init__(self, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(generation.upstream, "stream", lambda c, ids, s, rid, *_: short(str(c), ids, s))
        cfg = RouterConfig(spec=RouterSpec(port=1), model_name="smollm2", engine_dir=smollm2_dir,
                           groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")])  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(Router(cfg, ScriptedPool.of(cfg.groups)).app()), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())

    def post(self, path: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, str, float]:
        async def go() -> tuple[int, str]:
            r = await self.client.post(path, data=data, headers=headers or {"Content-Type": "application/json"})
            return r.status, await r.text()

        t0 = time.monotonic()
        status, text = self.loop.run_until_complete(asyncio.wait_for(go(), timeout=20))
        return status, text, time.monotonic() - t0

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture(scope="module")
def client(smollm2_dir: Path) -> Iterator[Client]:
    mp = pytest.MonkeyPatch()
    c = Client(smollm2_dir, mp)
    yield c
    c.close()
    mp.undo()


def check(status: int, text: str, seconds: float) -> None:
    assert status < 500, text[:500]
    assert seconds < 10, f"{seconds:.1f} s"
    if status >= 400:
        error = json.loads(text)["error"]  # OpenAI's shape
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    elif text.startswith("data: "):
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    else:
        assert json.loads(text)["choices"], text[:500]


def serves(client: Client) -> None:
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 2}).encode()
    status, text, _ = client.post("/v1/completions", body)
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2, text


def nested(n: int) -> dict[str, Any]:
    """A JSON schema of objects nested ``n`` deep (twice as deep in JSON)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_text(n: int) -> bytes:
    """``nested(n)`` as JSON text (deeper than ``json.dumps`` can write)."""
    return b'{"type": "object", "properties": {"a": ' * n + b'{"type": "string"}' + b"}}" * n


def deep(n: int) -> bytes:
    return b'{"model": "smollm2", "prompt": ' + b"[" * n + b"]" * n + b"}"


CORPUS: list[tuple[str, bytes, int]] = [  # (path, body, the status it must get)
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "temperature": 1e-40}).encode(), 200),
    (
        "/v1/completions",
        json.dumps({"model": "smollm2", "prompt": "x", "repetition_penalty": 1e-40, "temperature": 1.0}).encode(),
        200,
    ),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "stop": ["x" * 200_000]}).encode(), 400),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "stop": ["ab" * 500] * 4}).encode(), 200),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "\xff\xfe"}', 400),
    ("/v1/completions", deep(50_000), 400),
    ("/v1/completions", deep(900), 400),
    ("/v1/completions", b"x" * (2 << 20), 413),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "top_k": 2**40}).encode(), 400),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "seed": 2**62}).encode(), 200),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "max_tokens": 2**31}).encode(), 400),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "y" * 300_000, "max_tokens": 1}).encode(), 200),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": True,
                "top_logprobs": 10**6,
            }
        ).encode(),
        400,
    ),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "x", "temperature": NaN}', 400),
    ("/v1/chat/completions", json.dumps({"model": "smollm2", "messages": "hello"}).encode(), 400),
    ("/v1/completions", bytes(range(256)), 400),
    ("/v1/completions", b"", 400),
    ("/v1/completions", json.dumps([1, 2, 3]).encode(), 400),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "\x1d"}).encode(), 400),  # no tokens (the fuzzer's)
    # guides: the router checks them (cheaply, without the tokenizer); the decode node compiles them off its loop
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "guided_regex": "a{1000}{1000}"}).encode(), 200),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "guided_regex": "a" * 100_001}).encode(), 400),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "guided_regex": "(" * 3000}).encode(), 400),
    (
        "/v1/completions",
        json.dumps({"model": "smollm2", "prompt": "x", "guided_json": {"$ref": "#/nope"}}).encode(),
        400,
    ),
    ("/v1/completions", json.dumps({"model": "smollm2", "prompt": "x", "guided_json": nested(300)}).encode(), 400),
    ("/v1/completions", b'{"model": "smollm2", "prompt": "x", "guided_json": ' + nested_text(480) + b"}", 400),
    (
        "/v1/completions",
        json.dumps({"model": "smollm2", "prompt": "x", "ebnf": "root ::= " + "(" * 3000}).encode(),
        400,
    ),
]


@pytest.mark.parametrize(("path", "body", "want"), CORPUS, ids=[f"{i}" for i in range(len(CORPUS))])
def test_the_hostile_corpus_is_answered_in_openai_shape(client: Client, path: str, body: bytes, want: int) -> None:
    status, text, seconds = client.post(path, body)
    check(status, text, seconds)
    assert status == want, text[:300]
    serves(client)


def test_a_wrong_charset_is_read_as_utf8_json(client: Client) -> None:
    body = json.dumps({"model": "smollm2", "prompt": "é", "max_tokens": 1}).encode()
    status, text, _ = client.post("/v1/completions", body, {"Content-Type": "application/json; charset=latin-1"})
    assert status == 200, text


anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
small_numbers = st.integers(-3, 10) | st.floats(-3, 3) | st.sampled_from([1e-40, 2**31, 2**63, 2**64, -(2**63)])
hostile = anything | small_numbers | st.lists(st.text(max_size=6), max_size=6)
stops = st.text(min_size=1, max_size=8)
PLAUSIBLE = {  # values a careful or careless client sends; each field gets one of these 3 times in 4
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2) | st.sampled_from([1e-40, 5e-324, 2.0]),
    "top_p": st.floats(1e-300, 1) | st.just(1e-40),
    "top_k": st.integers(0, 2**31 - 1) | st.just(2**40),
    "seed": st.integers(0, 2**63 - 1),
    "stop": stops | st.lists(stops, max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 20),
    "n": st.just(1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(1e-300, 1e30) | st.sampled_from([1e-40, 1.0]),
    "ignore_eos": st.booleans(),
    "echo": st.booleans(),
    "user": st.text(max_size=10),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}])
    | st.fixed_dictionaries({"type": st.just("json_schema"),
                             "json_schema": st.fixed_dictionaries({"name": st.text(max_size=8), "schema": anything})}),
    "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 60000).map(str), st.floats(-100, 100), max_size=3),
    "guided_regex": st.text(max_size=12),
    "guided_choice": st.lists(st.text(max_size=6), max_size=3),
    "guided_json": anything,
    "guided_grammar": st.text(max_size=20) | st.just('root ::= "a" | "b"'),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar"]), anything,
                                          max_size=2),
}  # fmt: skip
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": st.text(max_size=30)})  # fmt: skip
prompts = st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 49151), min_size=1, max_size=6)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request for one of the two endpoints, a few fields set to plausible values (those a
    careful or careless client sends), and up to two fields (any, the required ones too) set to
    values of any type."""
    path = draw(st.sampled_from(PATHS))
    fields: dict[str, Any] = {"model": "smollm2", "max_tokens": 2}
    if path.endswith("chat/completions"):
        fields["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    else:
        fields["prompt"] = draw(prompts)
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=6, unique=True)):
        fields[name] = draw(PLAUSIBLE[name])
    keys = st.sampled_from(["model", "prompt", "messages", "extra_field", *sorted(PLAUSIBLE)])
    for name in draw(st.lists(keys, max_size=2, unique=True)):
        fields[name] = draw(hostile)
    return path, fields


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests())
def test_fuzzed_json_bodies_never_get_a_5xx(client: Client, request: tuple[str, dict[str, Any]]) -> None:
    path, fields = request
    status, text, seconds = client.post(path, json.dumps(fields).encode())
    check(status, text, seconds)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=200))
def test_fuzzed_raw_bodies_never_get_a_5xx(client: Client, path: str, raw: bytes) -> None:
    status, text, seconds = client.post(path, raw)
    check(status, text, seconds)


def test_the_router_serves_after_the_fuzzing(client: Client) -> None:
    serves(client)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    status, text, _ = client.post("/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200 and text.rstrip().endswith("data: [DONE]")


def test_what_passed_validation_runs_on_the_engine_beside_a_stream(client: Client, smollm2_dir: Path) -> None:
    """Every fuzzed request the router let through (its sampling values, guides, biases, penalties
    and stop ids as sent; prompts cut to their last 16 tokens, at most 4 new tokens) runs on the
    real SmolLM2 engine 24 at a time beside a greedy stream: none fails, except with a clear error
    of its own guide (one the engine's compiler refuses at submission, which the node answers as a
    400, or one that needs bytes no token of SmolLM2 holds: a regex of U+43FA5 needs the byte 0xF1,
    which its vocabulary lacks, and llguidance's mask then allows a token its parser refuses); the
    stream keeps the tokens it has alone, and every page comes back."""
    if len(ACCEPTED) < 300:  # run alone: fuzz first
        test_fuzzed_json_bodies_never_get_a_5xx(client)
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=256))
    beside = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then") if engine.tokenizer else []
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)  # longer than the others' 4
    alone = engine.generate([beside], greedy)[0]
    refused, ended = 0, {reason: 0 for reason in FinishReason}
    for at in range(0, len(ACCEPTED), 24):
        ids: list[str] = []
        for prompt, params in ACCEPTED[at : at + 24]:
            try:
                ids.append(engine.add_request(prompt[-16:], replace(params, max_tokens=min(params.max_tokens, 4))))
            except InvalidRequestError:
                refused += 1
        stream = engine.add_request(beside, greedy)
        while engine.has_unfinished():
            engine.step()
        assert list(engine.request(stream).output_ids) == alone
        for rid in ids:
            req = engine.request(rid)
            unfollowable = req.params.guide is not None and "the guide cannot be followed" in (req.error or "")
            assert req.state is RequestState.FINISHED or unfollowable, (req.params, req.error)
            ended[req.finish_reason] += 1  # type: ignore[index]
    assert engine.page_stats().used == 0
    assert refused + ended[FinishReason.ERROR] < len(ACCEPTED) // 10 and sum(ended.values()) >= 250, (refused, ended)

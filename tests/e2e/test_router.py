"""The front door end to end: the official ``openai`` client against ``disagg launch``'s router over two
decode groups and one prefill group (SmolLM2 fp32, greedy), compared with the engine run in-process."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, cast

import openai
import pydantic
import pytest
import torch

from bench.serve.deploy import Frontend, load_targets
from bench.serve.replay import replay
from bench.serve.workloads import BenchRequest
from frontend.api_guided import Tool
from frontend.chat_reply import ChatReply
from frontend.tool_format import auto_guide
from frontend.tool_reader import ToolFormat
from orchestrator.launch import JobState, Launch, run_processes
from serving.ports import free_port
from tests.deploy_harness import cluster, deployed
from torch_engine.config import EngineConfig, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.guided import Guide, GuideKind
from torch_engine.sampling import SamplingParams

KEY = "test-key-0123"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
N = 24


@pytest.fixture(scope="module")
def deployment(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launch]:
    groups = {"engine_dir": str(smollm2_dir), "num_pages": 256}
    cfg = cluster(
        tmp_path_factory.mktemp("router"),
        prefill={"count": 1, **groups},
        decode={"count": 2, **groups},
        router={"enabled": True, "port": free_port(), "api_key": KEY, "stall_timeout_s": 3, "probe_timeout_s": 2},
    )
    with deployed(cfg) as launch:
        yield launch


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=256, scheduler=SchedulerConfig(max_num_seqs=4)))


def _base(launch: Launch) -> str:
    assert launch.prepared is not None and launch.prepared.router_url is not None
    return launch.prepared.router_url


def _client(launch: Launch, key: str | None = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=_base(launch), api_key=key or "wrong", max_retries=0, timeout=120)


def _want(engine: LLMEngine, prompts: list[str], chat: bool, max_tokens: int = N) -> list[tuple[str, int, int]]:
    tok = engine.tokenizer
    assert tok is not None
    ids = [tok.encode(p, chat=chat) for p in prompts]
    outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens))
    return [(tok.decode(o), len(i), len(o)) for i, o in zip(ids, outs, strict=True)]


def _get(url: str, key: str | None = None) -> tuple[int, dict[str, object] | str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read().decode(), e.code
    try:
        return status, json.loads(body)
    except json.JSONDecodeError:
        return status, body


def test_chat_and_completions_equal_the_engine(deployment: Launch, engine: LLMEngine) -> None:
    client = _client(deployment)
    model = "smollm2"
    want_chat, want_text = _want(engine, PROMPTS, chat=True), _want(engine, PROMPTS, chat=False)
    for p, (text, n_prompt, n_out) in zip(PROMPTS, want_chat, strict=True):
        messages = [{"role": "user", "content": p}]
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].message.content == text
        assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
        assert r.choices[0].finish_reason == ("length" if n_out == N else "stop")
        chunks = list(
            client.chat.completions.create(  # type: ignore[call-overload]
                model=model, messages=messages, max_tokens=N, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == n_out
    for p, (text, n_prompt, n_out) in zip(PROMPTS, want_text, strict=True):
        c = client.completions.create(model=model, prompt=p, max_tokens=N, temperature=0)
        assert c.choices[0].text == text
        assert c.usage is not None and (c.usage.prompt_tokens, c.usage.completion_tokens) == (n_prompt, n_out)
        streamed = client.completions.create(model=model, prompt=p, max_tokens=N, temperature=0, stream=True)
        assert "".join(x.choices[0].text for x in streamed if x.choices) == text


def test_stop_strings_cut_the_text(deployment: Launch, engine: LLMEngine) -> None:
    client = _client(deployment)
    full = _want(engine, ["1, 2, 3, 4,"], chat=False)[0][0]
    stop = full.strip().split(" ")[2]  # a word some tokens in
    got = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=N, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="smollm2", prompt="1, 2, 3, 4,", max_tokens=N, temperature=0, stop=stop, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed if x.choices) == full[: full.index(stop)]


def test_penalties_reach_the_engine(deployment: Launch, engine: LLMEngine) -> None:
    tok = engine.tokenizer
    assert tok is not None
    prompt = "one one one one one one one one"
    want = tok.decode(engine.generate([prompt], SamplingParams(max_tokens=12, repetition_penalty=1.8))[0])
    got = _client(deployment).completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.8}
    )
    assert got.choices[0].text == want != _want(engine, [prompt], chat=False, max_tokens=12)[0][0]


def test_logit_bias_and_min_tokens_reach_the_engine(deployment: Launch, engine: LLMEngine) -> None:
    tok = engine.tokenizer
    assert tok is not None
    prompt = "The capital of France is"
    first = engine.generate([prompt], SamplingParams(max_tokens=1))[0][0]
    want = tok.decode(engine.generate([prompt], SamplingParams(max_tokens=8, logit_bias=((first, -100.0),)))[0])
    got = _client(deployment).completions.create(
        model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(first): -100}
    )
    assert got.choices[0].text == want
    held = _client(deployment).completions.create(
        model="smollm2", prompt=prompt, max_tokens=30, temperature=0, extra_body={"min_tokens": 30}
    )
    assert held.usage is not None and held.usage.completion_tokens == 30


def test_logprobs_of_greedy_tokens_are_the_top_alternative(deployment: Launch) -> None:
    r = _client(deployment).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the sampled token is the most likely
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob


@pytest.mark.parametrize(
    ("fields", "status", "code"),
    [
        ({"n": 65}, 400, None),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            None,
        ),
        ({"temperature": -1}, 400, None),
        ({"max_tokens": 0}, 400, None),
        ({"messages": []}, 400, None),
        ({"model": "gpt-4o"}, 404, "model_not_found"),
        ({"extra_body": {"cache_salt": ""}}, 400, None),
        ({"extra_body": {"cache_salt": "s" * 300}}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors(deployment: Launch, fields: dict[str, object], status: int, code: str) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | fields
    client = _client(deployment)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**body)  # type: ignore[call-overload]
    assert err.value.status_code == status
    error = err.value.body
    assert isinstance(error, dict) and error["message"] and error["type"] and error.get("code") == code
    ok = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert ok.choices[0].message.content  # the deployment keeps serving


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: Literal["Paris", "London", "Tokyo"]


def test_structured_output_equals_the_engine_and_parses(deployment: Launch, engine: LLMEngine) -> None:
    """``response_format`` through the disaggregated path gives the colocated engine's tokens for the same
    guide; the ``openai`` client's own ``parse`` (its strict schema from a pydantic model) gets a valid object;
    vLLM's and SGLang's fields reach the same grammar engine."""
    client, messages = _client(deployment), [{"role": "user", "content": "Invent a person. Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    got = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=48, temperature=0, response_format=fmt
    )  # type: ignore[call-overload]
    tok = engine.tokenizer
    assert tok is not None
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(PERSON))
    want = engine.generate([tok.encode(messages[0]["content"], chat=True)], SamplingParams(max_tokens=48, guide=guide))
    assert got.choices[0].message.content == tok.decode(want[0])
    value = json.loads(got.choices[0].message.content or "")
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    parsed = client.chat.completions.parse(model="smollm2", messages=messages, max_tokens=60, response_format=Person)  # type: ignore[arg-type]
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.city in ("Paris", "London", "Tokyo")
    phone = client.completions.create(
        model="smollm2", prompt="My phone number is", max_tokens=20, temperature=0.8, seed=1,
        extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
    )  # fmt: skip
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.choices[0].text), phone.choices[0].text
    for extra in ({"structured_outputs": {"choice": ["Paris", "Lyon"]}}, {"ebnf": 'root ::= "Paris" | "Lyon"'}):
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "The capital of France?"}], max_tokens=8,
            extra_body=extra,
        )  # fmt: skip
        assert r.choices[0].message.content in ("Paris", "Lyon") and r.choices[0].finish_reason == "stop"


def test_streams_carry_usage_on_every_chunk_when_asked(deployment: Launch) -> None:
    """guidellm's streamed requests send vLLM's ``continuous_usage_stats``: every chunk carries the counts."""
    chunks = list(
        _client(deployment).chat.completions.create(  # type: ignore[call-overload]
            model="smollm2", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            response_format={"type": "json_object"},
        )
    )  # fmt: skip
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and len(counts) == len([c for c in chunks if c.choices]) - 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == counts[-1]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")


@pytest.mark.parametrize(
    ("extra", "param", "match"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format", "invalid json_schema guide"),
        ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
        ({"guided_regex": "a", "regex": "b"}, None, "at most one structured-output field"),
        ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs", "invalid ebnf_grammar guide"),
    ],
)  # fmt: skip
def test_a_bad_guide_is_a_400_naming_the_field(deployment: Launch, extra: dict, param: str | None, match: str) -> None:
    client = _client(deployment)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra
        )
    body = err.value.body
    assert isinstance(body, dict) and match in body["message"] and (param is None or body["param"] == param)
    assert client.models.retrieve("smollm2").id == "smollm2"  # and GET /v1/models/{id} answers


def test_loglikelihood_scoring_as_lm_eval_sends_it_equals_hf(deployment: Launch, engine: LLMEngine, hf_smollm2) -> None:
    """lm-eval's ``local-completions`` loglikelihood call, as it sends it (token-id prompts in a batch,
    ``echo``, ``max_tokens: 1``, ``logprobs: 1``) and as it reads it (``token_logprobs[ctxlen:-1]`` summed,
    greedy when each equals its top alternative): the sums and greedy flags equal HF's log-softmax."""
    tok = engine.tokenizer
    assert tok is not None
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " London"), ("2 + 2 =", " 4")]
    encoded = [(tok.encode(c), tok.encode(x)) for c, x in pairs]
    r = _client(deployment).completions.create(
        model="smollm2", prompt=[c + x for c, x in encoded], max_tokens=1, temperature=0, logprobs=1, echo=True,
        seed=1234,
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, (ctx, cont) in zip(sorted(r.choices, key=lambda c: c.index), encoded, strict=True):
        ids, lp = ctx + cont, choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
        got = lp.token_logprobs[len(ctx) : -1]
        greedy = all(t == max(top.values()) for t, top in zip(got, lp.top_logprobs[len(ctx) : -1], strict=True))
        with torch.no_grad():
            ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)
        want = [float(ref[j - 1, ids[j]]) for j in range(len(ctx), len(ids))]
        assert sum(got) == pytest.approx(sum(want), abs=1e-3)
        assert greedy == all(int(ref[j - 1].argmax()) == ids[j] for j in range(len(ctx), len(ids)))
    sums = [sum(c.logprobs.token_logprobs[len(encoded[0][0]) : -1]) for c in r.choices[:2] if c.logprobs]  # type: ignore[index]
    assert sums[0] > sums[1]  # " Paris" over " London"
    scored = _client(deployment).completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=0, echo=True, logprobs=0
    )
    assert scored.choices[0].text == "The capital of France is" and scored.usage is not None
    lp = scored.choices[0].logprobs
    assert scored.usage.completion_tokens == 0 and lp is not None and len(lp.tokens or []) == len(encoded[0][0])


def test_n_choices_share_the_prompt_and_each_has_its_seed(deployment: Launch) -> None:
    """``n: 3``: three choices, the prompt counted once in ``usage``, choice 0 the single request's with
    the same seed, choice j that of seed + j; the same request again gives the same three."""
    client, messages = _client(deployment), [{"role": "user", "content": PROMPTS[1]}]
    ask = {"model": "smollm2", "messages": messages, "max_tokens": 10, "temperature": 1.0, "seed": 5}
    r = client.chat.completions.create(n=3, **ask)  # type: ignore[call-overload]
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    single = [client.chat.completions.create(**(ask | {"seed": 5 + j})) for j in range(3)]  # type: ignore[call-overload]
    assert texts == [s.choices[0].message.content for s in single]
    assert r.usage is not None and r.usage.prompt_tokens == single[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    again = client.chat.completions.create(n=3, **ask)  # type: ignore[call-overload]
    assert [c.message.content for c in sorted(again.choices, key=lambda c: c.index)] == texts


def _counted(launch: Launch) -> dict[str, float]:
    """The KV-movement counters of every leader, summed per counter and label set (role in front)."""
    assert launch.prepared is not None
    found: dict[str, float] = {}
    for ld in launch.prepared.leaders:
        text = _get(f"http://127.0.0.1:{ld.ports.metrics}/metrics")[1]
        assert isinstance(text, str)
        for m in re.finditer(r"^(disagg_(?:prefills|prefix_cache_tokens|kv_transfer_bytes)_total)\{([^}]*)\} (\S+)$",
                             text, re.MULTILINE):  # fmt: skip
            what = ",".join(x for x in m.group(2).split(",") if x and not x.startswith("model="))
            key = f"{ld.slot.role.name.lower()} {m.group(1)}{{{what}}}"
            found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def _moved(launch: Launch, request: Callable[[], object], want: dict[str, float]) -> dict[str, float]:
    """What ``request`` changed of the counters (``_counted``), once they show at least ``want``'s keys moved."""
    before = _counted(launch)
    request()
    deadline = time.monotonic() + 20
    while True:
        after = _counted(launch)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        if all(k in delta for k in want) or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def test_n_choices_prefill_and_move_the_prompt_once(deployment: Launch) -> None:
    """``n: 4`` on a fresh (salted) prompt through the router: the prompt is prefilled and its KV sent once —
    the same bytes and prefill-node tokens as a single request — and the other three choices, on the decode
    group the first chose, share its full pages, copy its partial last page and compute their last token
    each on the decoder, the whole prompt but that token counted as cached. (Before the partial-page copy:
    4 remote prefills, 7,372,800 bytes and 436 prefill-node tokens looked up, against 5,160,960 and 109.)"""
    client = _client(deployment)
    text = " ".join(f"item{i}" for i in range(40))  # ~110 tokens: the KV of 6 full 16-token pages and a partial one
    out: list[Any] = []

    def ask(n: int, salt: str) -> None:  # ignore_eos: the first choice still runs when the others start
        out.append(client.completions.create(model="smollm2", prompt=text, max_tokens=24, temperature=1.0, seed=3,
                                             n=n, extra_body={"cache_salt": salt, "ignore_eos": True}))  # fmt: skip

    sent = "prefill disagg_kv_transfer_bytes_total{}"
    n4 = _moved(deployment, lambda: ask(4, "n4"), {sent: 1})
    one = _moved(deployment, lambda: ask(1, "n1"), {sent: 1})
    prompt = out[0].usage.prompt_tokens
    assert len(out[0].choices) == 4 and prompt % 16 != 1  # a partial page to copy
    assert n4[sent] == one[sent] > 0  # the KV of the prompt moved once
    queried = 'prefill disagg_prefix_cache_tokens_total{kind="queried"}'
    assert n4[queried] == one[queried] == prompt - 1  # the prefill node computed the prompt once
    assert 'prefill disagg_prefix_cache_tokens_total{kind="found"}' not in one  # salts are kept apart there too
    assert n4['decode disagg_prefills_total{where="remote"}'] == 1  # the others: one token each, not a prefill
    assert 'decode disagg_prefills_total{where="local"}' not in n4
    assert n4['decode disagg_prefix_cache_tokens_total{kind="found"}'] == 3 * (prompt - 1)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_forced_tool_calls_follow_the_function_schema(deployment: Launch) -> None:
    """``tool_choice`` naming a function or ``required``: the call is written under the grammar, so its
    arguments satisfy the function's schema; ``tool_calls`` and ``finish_reason: tool_calls`` as OpenAI
    sends them, streamed too (the arguments in pieces); a tool's answer in the history is taken."""
    client = _client(deployment)
    create = cast(Any, client.chat.completions).create  # the calls' dicts, unchecked by the client's overloads
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    # sampled (temperature 1, the default) under the grammar; one seed, so the streamed call equals the other
    ask = functools.partial(create, model="smollm2", messages=messages, max_tokens=40, seed=7)
    r = ask(tools=[WEATHER], tool_choice=named)
    call = (r.choices[0].message.tool_calls or [None])[0]
    assert r.choices[0].finish_reason == "tool_calls" and call is not None and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    either = ask(tools=[WEATHER, TIME], tool_choice="required")
    assert either.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    stream = ask(tools=[WEATHER], tool_choice=named, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [t for d in deltas for t in (d.delta.tool_calls or [])]
    assert deltas[-1].finish_reason == "tool_calls" and streamed[0].function.name == "get_weather"
    assert "".join(t.function.arguments or "" for t in streamed) == call.function.arguments and len(streamed) > 2
    history = [*messages, {"role": "assistant", "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]  # fmt: skip
    answer = create(model="smollm2", messages=history, max_tokens=12)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def _weather_args(arguments: str) -> bool:
    """``get_weather``'s schema, checked by hand: exactly city (a string of at most 20) and unit (an enum)."""
    args = json.loads(arguments)
    return (
        set(args) == {"city", "unit"} and isinstance(args["city"], str) and len(args["city"]) <= 20
        and args["unit"] in ("celsius", "fahrenheit")
    )  # fmt: skip


def test_auto_tool_choice_lets_the_model_call_or_answer(deployment: Launch, engine: LLMEngine) -> None:
    """``tool_choice: auto`` (the default with tools) on SmolLM2, whose template has no tool format: the
    router lists the tools and asks for ``<tool_call>`` blocks; after one call in the history the model
    calls again for a new city (the engine's own tokens, read as OpenAI's ``tool_calls``), and answers a
    greeting in words. The openai client's stream helper assembles the streamed deltas into the same
    message; sampled replies are each a call that satisfies the schema or plain content."""
    client = _client(deployment)
    create = cast(Any, client.chat.completions).create
    prior = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}  # fmt: skip
    oslo = {"role": "user", "content": "What is the weather in Oslo?"}
    history: list[dict[str, Any]] = [oslo, {"role": "assistant", "tool_calls": [prior]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
               {"role": "assistant", "content": "It is -3 C in Oslo."},
               {"role": "user", "content": "What is the weather in Paris?"}]  # fmt: skip
    ask = functools.partial(create, model="smollm2", tools=[WEATHER], max_tokens=40, temperature=0)
    r = ask(messages=history)
    choice = r.choices[0]
    call = (choice.message.tool_calls or [None])[0]
    assert choice.finish_reason == "tool_calls" and call is not None and call.function.name == "get_weather", choice
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"} and call.id.startswith("call_")
    tok = engine.tokenizer
    assert tok is not None
    ids = _rendered(deployment, history)
    want = tok.decode(engine.generate([ids], SamplingParams(max_tokens=40, guide=_auto_guide()))[0])
    mine = ChatReply(ToolFormat.HERMES, str).message(want)  # the engine's tokens, read as the router reads them
    assert mine.tool_calls and mine.tool_calls[0].function.model_dump() == call.function.model_dump(), want
    helper = cast(Any, client.chat.completions).stream
    with helper(model="smollm2", messages=history, tools=[WEATHER], max_tokens=40, temperature=0) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls is not None
    got = final.message.tool_calls[0].function
    assert (got.name, got.arguments) == (call.function.name, call.function.arguments)
    hello = ask(messages=[{"role": "user", "content": "Hi! How are you?"}], tool_choice="auto")
    assert hello.choices[0].finish_reason in ("stop", "length") and hello.choices[0].message.content
    assert not hello.choices[0].message.tool_calls
    calls = 0
    for seed in range(6):  # a call cut by max_tokens ends with "length", its arguments as far as they got
        sampled = ask(messages=history, temperature=0.7, seed=seed, max_tokens=80).choices[0]
        made = sampled.message.tool_calls or []
        complete = made if sampled.finish_reason == "tool_calls" else made[:-1]
        assert all(c.function.name == "get_weather" and _weather_args(c.function.arguments) for c in complete)
        assert (sampled.finish_reason == "tool_calls") == bool(made) or sampled.finish_reason == "length"
        assert "<tool_call>" not in (sampled.message.content or "")
        calls += bool(complete)
    assert calls >= 1


class Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    answer: str
    confidence: float


class GetWeather(pydantic.BaseModel):
    """The weather in a city"""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def test_tools_beside_a_response_format_through_the_openai_parse_helper(deployment: Launch) -> None:
    """The openai client's ``chat.completions.parse`` with a pydantic ``response_format`` and a strict
    pydantic function tool (``tool_choice`` auto): greedy and sampled, every reply the client parses
    is either a call of the tool with arguments it validates or an ``Answer`` (a reply cut by
    ``max_tokens`` is the client's ``LengthFinishReasonError``)."""
    client = _client(deployment)
    parse = functools.partial(
        client.chat.completions.parse, model="smollm2", response_format=Answer, max_tokens=120,
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )  # fmt: skip
    seen: list[str] = []
    for kwargs in [{"temperature": 0}] + [{"temperature": 0.8, "seed": s} for s in range(4)]:
        try:
            message = parse(**kwargs).choices[0].message
        except openai.LengthFinishReasonError:
            seen.append("cut")
            continue
        if message.tool_calls:
            args = [c.function.parsed_arguments for c in message.tool_calls]
            assert all(isinstance(a, GetWeather) and a.city for a in args), message
            seen.append("call")
        else:
            assert isinstance(message.parsed, Answer) and message.parsed.answer, message
            seen.append("answer")
    assert seen.count("cut") < len(seen), seen  # SmolLM2 may repeat its call until max_tokens


def _rendered(launch: Launch, messages: list[dict[str, Any]]) -> list[int]:
    """The router's prompt for ``messages`` with ``WEATHER`` offered (its ``/tokenize``)."""
    base = _base(launch).removesuffix("/v1")
    body = json.dumps({"model": "smollm2", "messages": messages, "tools": [WEATHER]}).encode()
    req = urllib.request.Request(f"{base}/tokenize", data=body, headers={"Authorization": f"Bearer {KEY}",
                                 "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return cast(list[int], json.loads(r.read())["tokens"])


def _auto_guide() -> Guide:
    guide = auto_guide([Tool.model_validate(WEATHER)], ToolFormat.HERMES)
    assert guide is not None
    return guide


def test_a_conversation_reuses_its_history_on_the_group_that_holds_it(deployment: Launch, engine: LLMEngine) -> None:
    """A multi-turn chat: each turn goes to the decode group whose prefix cache holds the history
    (the router's index, from the groups' KV events), reports the reused tokens in OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` and says what the engine says, token for token."""
    client = _client(deployment)
    tok = engine.tokenizer
    assert tok is not None
    system = "You are a careful assistant who answers briefly and exactly. " * 12
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    cached: list[int] = []
    groups: list[str] = []
    lengths: list[int] = []
    for question in ["Name a colour.", "Name another one.", "And a third?"]:
        messages.append({"role": "user", "content": question})
        before = _served(deployment)
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        answer = r.choices[0].message.content or ""
        ids = tok.encode_chat(messages)
        assert answer == tok.decode(engine.generate([ids], SamplingParams(max_tokens=8))[0])
        assert r.usage is not None and r.usage.prompt_tokens == len(ids)
        details = r.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None
        cached.append(details.cached_tokens)
        lengths.append(len(ids))
        after = _served(deployment)
        groups += [g for g in after if after[g] > before.get(g, 0.0)]
        messages.append({"role": "assistant", "content": answer})
        time.sleep(2.5)  # the router polls the groups' events with each readiness probe (every second)
    assert len(groups) == 3 and len(set(groups)) == 1, groups  # the router followed the cache
    for t in (1, 2):  # the whole history but its last page or two
        assert cached[t] >= lengths[t - 1] // 16 * 16 - 16 > 0, (cached, lengths)
    assert cached[0] < cached[1] < cached[2]


def test_the_api_key_is_required_except_for_health(deployment: Launch) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(deployment, key=None).models.list()
    assert [m.id for m in _client(deployment).models.list().data] == ["smollm2"]
    base = _base(deployment).removesuffix("/v1")
    status, body = _get(f"{base}/health")
    assert status == 200 and isinstance(body, dict) and body["status"] == "ready"
    assert _get(f"{base}/metrics")[0] == 401 and _get(f"{base}/metrics", KEY)[0] == 200
    metrics = _get(f"{base}/metrics", KEY)[1]
    assert isinstance(metrics, str)
    families = ("disagg_router_time_to_first_token_seconds", "disagg_router_requests_total", "disagg_router_in_flight")
    assert all(f in metrics for f in families)


def test_concurrent_streams_spread_over_both_decode_groups(deployment: Launch, engine: LLMEngine) -> None:
    prompts = [f"Count from {i} to {i + 5}:" for i in range(16)]
    want = [w[0] for w in _want(engine, prompts, chat=False, max_tokens=12)]
    client = openai.AsyncOpenAI(base_url=_base(deployment), api_key=KEY, max_retries=0, timeout=300)

    async def one(p: str) -> str:
        stream = await client.completions.create(model="smollm2", prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join([x.choices[0].text async for x in stream if x.choices])

    async def go() -> list[str]:
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    before = _served(deployment)
    assert asyncio.run(go()) == want
    after = _served(deployment)
    assert set(after) == {"decode0", "decode1"}
    assert all(after[g] > before.get(g, 0.0) for g in after), (before, after)


def _served(launch: Launch) -> dict[str, float]:
    text = _get(f"{_base(launch).removesuffix('/v1')}/metrics", KEY)[1]
    assert isinstance(text, str)
    return {m[1]: float(m[2]) for m in re.finditer(r'disagg_router_served_total\{group="(\w+)"\} ([\d.e+]+)', text)}


def test_a_client_that_disconnects_frees_its_pages(deployment: Launch) -> None:
    client = _client(deployment)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=400,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    base = _base(deployment).removesuffix("/v1")
    assert deployment.prepared is not None
    ports = [ld.ports.metrics for ld in deployment.prepared.leaders]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_used_pages(p) for p in ports):
        time.sleep(0.25)
    assert [_used_pages(p) for p in ports] == [0.0] * len(ports)
    metrics = _get(f"{base}/metrics", KEY)[1]
    assert isinstance(metrics, str) and 'status="499"' in metrics  # counted as the client's cancellation


def _used_pages(port: int) -> float:
    text = _get(f"http://127.0.0.1:{port}/metrics")[1]
    assert isinstance(text, str)
    found = re.search(r'disagg_kv_pages\{[^}]*state="used"[^}]*\} ([\d.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_the_serving_benchmark_drives_the_router_and_request_ids_reach_the_traces(deployment: Launch) -> None:
    to = load_targets(deployment, Frontend.ROUTER)
    assert to.urls == [_base(deployment)] and to.model == "smollm2" and to.api_key == KEY
    reqs = [BenchRequest(prompt=f"Tell me about the number {i}.", prompt_tokens=8, max_tokens=6) for i in range(4)]
    done, _ = asyncio.run(replay(to, reqs, [0.0, 0.1, 0.2, 0.3], "benchtag", 120))
    assert [c.error for c in done] == [None] * 4
    assert all(c.ttft is not None and len(c.times) >= 1 for c in done)
    traced = "".join(p.read_text(encoding="utf-8") for p in (deployment.run_dir / "traces").glob("decode*.jsonl"))
    assert all(f"benchtag-{i}#" in traced for i in range(4))  # the client's id names it on the decode node
    req = urllib.request.Request(
        f"{_base(deployment)}/completions",
        data=json.dumps({"model": "smollm2", "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "my-id-1", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["X-Request-Id"] == "my-id-1"


def test_a_hung_decode_group_is_given_up_and_taken_back(deployment: Launch, engine: LLMEngine) -> None:
    """Every process of decode group 1 stopped (SIGSTOP: its ports still accept connections, nothing
    answers: a wedged node, not a dead one) while requests run through the router. The probes find it
    silent, take it out of rotation and, after ``stall_timeout_s``, give up the requests waiting on it:
    each is retried on decode group 0 and every request gets the engine's text, none waits out the
    600 s request deadline. Resumed (SIGCONT), the group comes back into rotation and serves again."""
    prompts = [f"Name {i} colours:" for i in range(8)]
    want = [w[0] for w in _want(engine, prompts, chat=False, max_tokens=8)]
    pids = list(run_processes(deployment.run_id, "decode1"))
    assert pids
    client = openai.AsyncOpenAI(base_url=_base(deployment), api_key=KEY, max_retries=0, timeout=120)
    base = _base(deployment).removesuffix("/v1")

    async def one(p: str) -> str:
        r = await client.completions.create(model="smollm2", prompt=p, max_tokens=8, temperature=0)
        return r.choices[0].text

    async def while_stopped() -> tuple[list[str], float]:
        try:
            t0 = time.monotonic()
            got = list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=90))
            return got, time.monotonic() - t0
        finally:
            await client.close()

    before = _served(deployment).get("decode1", 0.0)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        got, seconds = asyncio.run(while_stopped())
        health = _get(f"{base}/health")[1]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert got == want, got
    assert _served(deployment).get("decode1", 0.0) > before  # some were sent to the stopped group first
    assert isinstance(health, dict) and not health["groups"]["decode1"]["up"]  # type: ignore[index]
    assert seconds < 60
    deadline = time.monotonic() + 60
    while not _get(f"{base}/health")[1]["groups"]["decode1"]["up"]:  # type: ignore[index]
        assert time.monotonic() < deadline, _get(f"{base}/health")
        time.sleep(0.5)
    served = _served(deployment).get("decode1", 0.0)

    async def spread() -> list[str]:
        again = openai.AsyncOpenAI(base_url=_base(deployment), api_key=KEY, max_retries=0, timeout=120)

        async def short(p: str) -> str:
            r = await again.completions.create(model="smollm2", prompt=p, max_tokens=8, temperature=0)
            return r.choices[0].text

        try:  # at once: the router spreads them by outstanding tokens
            return list(await asyncio.gather(*(short(p) for p in prompts)))
        finally:
            await again.close()

    assert asyncio.run(spread()) == want
    assert _served(deployment).get("decode1", 0.0) > served  # back in rotation, serving


def test_a_dead_decode_group_leaves_the_router_and_comes_back(deployment: Launch, engine: LLMEngine) -> None:
    """Last in this module (it kills a group): every process of decode group 1 killed while streams
    run through the router. Each stream completes with the engine's text or fails with an error (none
    hangs); new requests keep being served (by decode group 0) meanwhile; the launcher restarts group
    1 and the router's probe takes it back into rotation, where it serves again."""
    prompts = [f"Count from {i} to {i + 9}:" for i in range(12)]
    want = [w[0] for w in _want(engine, prompts, chat=False, max_tokens=24)]
    client = openai.AsyncOpenAI(base_url=_base(deployment), api_key=KEY, max_retries=0, timeout=120)

    async def one(p: str) -> str | Exception:
        try:
            stream = await client.completions.create(
                model="smollm2", prompt=p, max_tokens=24, temperature=0, stream=True
            )
            return "".join([x.choices[0].text async for x in stream if x.choices])
        except openai.APIError as exc:  # the group died under it: an error, not a hang
            return exc

    async def load_then_kill() -> tuple[list[str | Exception], list[str | Exception]]:
        try:
            jobs = [asyncio.ensure_future(one(p)) for p in prompts]
            await asyncio.sleep(0.5)
            for pid in run_processes(deployment.run_id, "decode1"):
                os.kill(pid, signal.SIGKILL)
            first = list(await asyncio.wait_for(asyncio.gather(*jobs), timeout=120))
            during = list(await asyncio.gather(*(one(p) for p in prompts[:4])))  # group 0 serves meanwhile
            return first, during
        finally:
            await client.close()

    first, during = asyncio.run(load_then_kill())
    assert all(isinstance(r, Exception) or r == w for r, w in zip(first, want, strict=True)), first
    assert during == want[:4]
    job = deployment.jobs["decode1"]
    deadline = time.monotonic() + 180
    while not (job.state is JobState.UP and job.generation == 1):
        assert deployment.check() is None, deployment.events
        assert time.monotonic() < deadline, deployment.events
        time.sleep(0.2)
    base = _base(deployment).removesuffix("/v1")
    while not _get(f"{base}/health")[1]["groups"]["decode1"]["up"]:  # type: ignore[index]
        assert time.monotonic() < deadline, _get(f"{base}/health")
        time.sleep(0.5)
    served = _served(deployment).get("decode1", 0.0)
    again = openai.AsyncOpenAI(base_url=_base(deployment), api_key=KEY, max_retries=0, timeout=120)

    async def spread() -> list[str]:
        async def short(p: str) -> str:
            r = await again.completions.create(model="smollm2", prompt=p, max_tokens=8, temperature=0)
            return r.choices[0].text

        try:  # at once: the router spreads them by outstanding tokens
            return list(await asyncio.gather(*(short(p) for p in prompts[:8])))
        finally:
            await again.close()

    assert all(asyncio.run(spread()))
    assert _served(deployment).get("decode1", 0.0) > served  # the restarted group serves again
    assert "decode group 1 TP rank 0" in "\n".join(deployment.events)

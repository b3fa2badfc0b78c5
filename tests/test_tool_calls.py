"""Tool calls with ``tool_choice: auto``: the format read from the chat template, the reply read for
calls as it streams (the same reading whole or in any chunking, token boundaries included), the grammar
that leaves text free and holds an opened call to its function's schema, and the router's answers —
content, then a call's header and its arguments piece by piece, ``finish_reason: tool_calls`` — against
scripted decode groups."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncGenerator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend.api_guided import Tool
from frontend.api_types import ChatCompletionRequest
from frontend.config import GroupEndpoint, RouterConfig, RouterSpec
from frontend.generation import Generator
from frontend.metrics import RouterMetrics
from frontend.tool_format import ToolStyle, auto_guide, tool_style
from frontend.tool_reader import CallReader, Read, ToolFormat
from frontend.upstream import Piece
from tests.router_harness import ScriptedPool, scripted_router
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.guided import GrammarTable, Guide, GuideKind
from torch_engine.request import FinishReason
from torch_engine.sampling import SamplingParams
from torch_engine.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
HERMES_REPLY = f"Let me look that up.\n<tool_call>\n{CALL}\n</tool_call>\n"

# A Hermes-style template (as Qwen 2.5's renders tools): the tools listed, calls in <tool_call> tags.
NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Return each call as a JSON object within <tool_call></tool_call> tags.<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def read(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) from a reply fed in ``pieces``; each call's header must come first."""
    reader, out = CallReader(fmt, lambda k: f"call_{k}"), Read()
    for p in pieces:
        out += reader.feed(p)
    out += reader.finish()
    calls: list[dict[str, Any]] = []
    for d in out.calls:
        if d.name is not None:
            assert d.index == len(calls) and d.call_id == f"call_{d.index}"
            calls.append({"name": d.name, "arguments": d.arguments})
        else:
            calls[d.index]["arguments"] += d.arguments
    return out.content, calls


NAMELESS = '<tool_call>\n{"arguments": {}}\n</tool_call>'
CASES = [
    (ToolFormat.HERMES, HERMES_REPLY + f"<tool_call>\n{CALL}\n</tool_call>", "Let me look that up.", 2),
    (ToolFormat.HERMES, '<tool_call>\n{"arguments": {"a": [1, {"b": "}"}]}, "name": "f"}\n</tool_call>', "", 1),
    (ToolFormat.HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", 1),
    (ToolFormat.HERMES, "a < b, and <tool is not <tool_call", "a < b, and <tool is not <tool_call", 0),
    (ToolFormat.HERMES, "<tool_call>\nnot JSON\n</tool_call>", "<tool_call>\nnot JSON\n</tool_call>", 0),
    (
        ToolFormat.HERMES,
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        0,
    ),
    (ToolFormat.LLAMA3_JSON, ' {"name": "f", "parameters": {"x": 1.5e3}}; {"name": "g", "parameters": {}}', "", 2),
    (ToolFormat.LLAMA3_JSON, 'It is {"name": "f"}', 'It is {"name": "f"}', 0),
    (ToolFormat.MISTRAL, '[{"name": "f", "arguments": {"q": "a,b]"}}, {"name": "g", "arguments": {}}]', "", 2),
    (ToolFormat.JSON, CALL, "", 1),
    (ToolFormat.JSON, '{"name": "f", "arguments": {"q": 1', "", 1),  # cut by max_tokens: as far as it got
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_a_reply_reads_the_same_whole_and_in_any_chunking(fmt: ToolFormat, text: str, content: str, calls: int) -> None:
    whole = read(fmt, [text])
    assert whole[0] == content and len(whole[1]) == calls
    for c in whole[1]:
        if text.endswith("}") or text.endswith(">"):
            parsed = json.loads(c["arguments"])
            assert isinstance(parsed, dict)
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert read(fmt, pieces) == whole, pieces


def test_arguments_stream_piece_by_piece_at_token_boundaries(smollm2_dir: Path) -> None:
    """Fed as SmolLM2's detokenizer emits it, a call's header goes out once its name is complete and
    its arguments in several pieces that join to the arguments' JSON text."""
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode(HERMES_REPLY)
    pieces = [tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]  # fmt: skip
    reader, sent = CallReader(ToolFormat.HERMES, lambda k: f"call_{k}"), []
    for p in pieces:
        sent.append(reader.feed(p))
    sent.append(reader.finish())
    calls = [d for r in sent for d in r.calls]
    assert calls[0].name == "get_weather" and calls[0].arguments == ""
    assert len(calls) > 3 and "".join(d.arguments for d in calls) == CALL[CALL.index('{"city"') : -1]
    assert "".join(r.content for r in sent) == "Let me look that up."
    assert read(ToolFormat.HERMES, pieces) == read(ToolFormat.HERMES, [HERMES_REPLY])


def test_the_format_comes_from_the_chat_template() -> None:
    assert tool_style("auto", NATIVE_TEMPLATE) == ToolStyle(ToolFormat.HERMES, native=True)
    assert tool_style("auto", "{{ '[TOOL_CALLS]' }}{% if tools %}{% endif %}").fmt is ToolFormat.MISTRAL
    assert tool_style("auto", "{{- '<|python_tag|>' }}").fmt is ToolFormat.LLAMA3_JSON
    smol = "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"
    assert tool_style("auto", smol) == ToolStyle(ToolFormat.HERMES, native=False)  # asked for in a system turn
    assert tool_style("llama3_json", smol) == ToolStyle(ToolFormat.LLAMA3_JSON, native=False)


def test_the_auto_grammar_leaves_text_free_and_holds_an_opened_call_to_the_schema(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir)
    table = GrammarTable(tok.hf, len(tok.hf))
    guide = auto_guide([Tool.model_validate(WEATHER)], ToolFormat.HERMES)
    assert guide is not None and guide.kind is GuideKind.LARK

    def accepts(text: str) -> bool:
        m = table.matcher(guide)
        return m.valid_prefix(tok.encode(text)) == len(tok.encode(text))

    assert accepts("The weather is fine, <b>no</b> need to call anything.\n\nBye")
    assert accepts(HERMES_REPLY + "Anything after a call.")
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {}}')  # not one of the tools
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": 1}}')  # not its schema
    assert not accepts("<tool_call>\nI will call it now")  # an opened call is a call


@pytest.mark.parametrize("reply", [None, {"type": "object"}])
@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.LLAMA3_JSON])
def test_without_parallel_calls_a_reply_holds_at_most_one_call(
    smollm2_dir: Path, fmt: ToolFormat, reply: dict[str, Any] | None
) -> None:
    """``parallel_tool_calls: false``: one call and the reply ends there; free text (or the reply's
    JSON) as before; parallel (the default) allows a second call."""
    tok = Tokenizer(smollm2_dir)
    table = GrammarTable(tok.hf, len(tok.hf))
    one = auto_guide([Tool.model_validate(WEATHER)], fmt, reply, parallel=False)
    many = auto_guide([Tool.model_validate(WEATHER)], fmt, reply)
    assert one is not None and many is not None

    def takes(guide: Guide, text: str) -> bool:
        ids = tok.encode(text)
        return table.matcher(guide).valid_prefix(ids) == len(ids)

    call = CALL if fmt is ToolFormat.HERMES else CALL.replace('"arguments"', '"parameters"')
    block = f"<tool_call>\n{call}\n</tool_call>" if fmt is ToolFormat.HERMES else call
    twice = f"{block}\n{block}" if fmt is ToolFormat.HERMES else f"{call}; {call}"
    assert takes(one, block) and takes(many, block)
    assert not takes(one, twice) and takes(many, twice)
    assert takes(one, "Hello there" if reply is None else '{"a": 1}')
    if fmt is ToolFormat.HERMES and reply is None:
        assert takes(one, "Let me look that up.\n" + block)
        assert not takes(one, block + "\nAnd some words after it.")
        assert not takes(one, "<tool_call>\nI will call it now")


def saying(text: str, tok: Tokenizer, seen: list[tuple[list[int], SamplingParams]]) -> Any:
    """A decode group that answers ``text`` token by token (and notes what it was sent)."""

    async def script(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
        seen.append((ids, s))
        out = tok.encode(text)
        for i in range(1, len(out) + 1):
            yield Piece(tuple(out[:i]), i - 1, i, "stop" if i == len(out) else "")

    return script


def chat(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, text: str, bodies: list[dict[str, Any]]) -> Any:
    """Each body through the router over one group that answers ``text``: (status, body or SSE events)."""
    seen: list[tuple[list[int], SamplingParams]] = []
    router, _ = scripted_router(smollm2_dir, {"a": saying(text, Tokenizer(smollm2_dir), seen)}, monkeypatch)

    async def go() -> list[tuple[int, Any]]:
        out = []
        async with TestClient(TestServer(router.app())) as client:
            for body in bodies:
                r = await client.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 99} | body)
                raw = await r.text()
                if body.get("stream"):
                    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
                    out.append((r.status, [json.loads(e) for e in events if e != "[DONE]"]))
                else:
                    out.append((r.status, json.loads(raw)))
        return out

    return asyncio.run(go()), seen, router


def test_auto_calls_stream_as_openai_streams_them(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ask = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    (plain, streamed, none), seen, router = chat(
        smollm2_dir, monkeypatch, HERMES_REPLY, [ask, ask | {"stream": True}, ask | {"tool_choice": "none"}]
    )
    assert plain[0] == 200
    choice = plain[1]["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look that up."
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}

    status, events = streamed
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert status == 200 and deltas[0]["delta"]["role"] == "assistant"
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    pieces = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    head, rest = pieces[0], pieces[1:]
    assert content == "Let me look that up." and deltas[-1]["finish_reason"] == "tool_calls"
    assert head["id"].startswith("call_") and head["type"] == "function" and head["function"]["name"] == "get_weather"
    assert len(rest) > 3 and all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest)
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]

    assert none[1]["choices"][0]["message"]["content"] == HERMES_REPLY  # tool_choice none: nothing read
    assert none[1]["choices"][0]["finish_reason"] == "stop"
    (ids, s), _, (ids_none, s_none) = seen
    prompt = router.gen.tokenizer.decode(ids)
    assert (
        "get_weather" in prompt
        and "<tool_call>" in prompt
        and "get_weather" not in router.gen.tokenizer.decode(ids_none)
    )
    assert s.guide is not None and s.guide.kind is GuideKind.LARK and s_none.guide is None


def test_a_reply_without_a_call_is_content(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ask = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "tool_choice": "auto"}
    (plain, streamed), _, _ = chat(smollm2_dir, monkeypatch, "Hello! 1 < 2 <tool", [ask, ask | {"stream": True}])
    assert plain[1]["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello! 1 < 2 <tool",
        "tool_calls": None,
    }
    assert plain[1]["choices"][0]["finish_reason"] == "stop"
    deltas = [e["choices"][0] for e in streamed[1] if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hello! 1 < 2 <tool"
    assert deltas[-1]["finish_reason"] == "stop" and not any(d["delta"].get("tool_calls") for d in deltas)


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.LLAMA3_JSON])
def test_auto_with_a_response_format_is_calls_or_a_reply_in_its_schema(smollm2_dir: Path, fmt: ToolFormat) -> None:
    tok = Tokenizer(smollm2_dir)
    table = GrammarTable(tok.hf, len(tok.hf))
    guide = auto_guide([Tool.model_validate(WEATHER)], fmt, ANSWER)
    assert guide is not None

    def accepts(text: str, whole: bool = True) -> bool:
        ids = tok.encode(text)
        m = table.matcher(guide)
        if m.valid_prefix(ids) != len(ids):
            return False
        for t in ids:
            m.accept(t)
        return m.accepting or not whole

    call = CALL if fmt is ToolFormat.HERMES else CALL.replace('"arguments"', '"parameters"')
    calls = f"<tool_call>\n{call}\n</tool_call>" if fmt is ToolFormat.HERMES else call
    assert accepts('{"answer": "Paris", "confidence": 0.9}')
    assert accepts(calls)
    assert not accepts('{"answer": "Paris"}')  # not the reply's schema (a key missing)
    assert not accepts("Sure, here it is", whole=False)  # no free text
    assert not accepts(HERMES_REPLY, whole=False)  # no text before a call either
    assert auto_guide([Tool.model_validate(WEATHER)], ToolFormat.MISTRAL, ANSWER) is None


def test_auto_takes_a_response_format_and_nothing_else(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ask = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply = '{"answer": "hello", "confidence": 1}'
    bodies = [
        ask | {"response_format": schema},
        ask | {"response_format": {"type": "json_object"}, "stream": True},
        ask | {"guided_regex": "a+"},
        ask | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
        ask | {"response_format": schema, "parallel_tool_calls": False},
    ]
    ((ok, body), (streamed, events), (bad, error), (broken, why), (single, _)), seen, _ = chat(
        smollm2_dir, monkeypatch, reply, bodies
    )
    one = seen[-1][1].guide
    assert single == 200 and one is not None and one.text.startswith("start: call | reply")
    assert ok == 200 and body["choices"][0]["message"]["content"] == reply
    assert body["choices"][0]["message"]["tool_calls"] is None and body["choices"][0]["finish_reason"] == "stop"
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert streamed == 200 and "".join(d["delta"].get("content") or "" for d in deltas) == reply
    guide = seen[0][1].guide
    assert (
        guide is not None
        and guide.kind is GuideKind.LARK
        and '"confidence"' in guide.text
        and "get_weather" in guide.text
    )
    assert bad == 400 and "cannot be combined with guided_regex" in error["error"]["message"]
    assert broken == 400 and why["error"]["param"] == "response_format", why


def test_a_native_template_renders_the_tools_and_the_history(smollm2_dir: Path, tmp_path: Path) -> None:
    """A template with its own tool format gets the tools and structured calls; tool turns keep their role."""
    folder = tmp_path / "engine"
    folder.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    (folder / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    cfg = RouterConfig(spec=RouterSpec(port=1), model_name="smollm2", engine_dir=folder,
                       groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")])  # fmt: skip
    pool = ScriptedPool.of(cfg.groups)
    gen = Generator(cfg, pool, RouterMetrics(pool))
    assert gen.tool_style == ToolStyle(ToolFormat.HERMES, native=True)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = ChatCompletionRequest.model_validate({
        "model": "smollm2", "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}],
    })  # fmt: skip
    text = gen.tokenizer.decode(gen.chat_prompt(req))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "tool\n-3 C" in text and text.endswith("assistant\n")
    assert "You may call these functions" not in text  # the template listed them, not the router


def test_each_streamed_choice_reads_its_own_calls(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``n`` = 2 streamed with tools: every choice's deltas carry its own call (ids differ), under its index."""
    ask = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "n": 2, "stream": True}
    ((status, events),), _, _ = chat(smollm2_dir, monkeypatch, HERMES_REPLY, [ask])
    assert status == 200
    for index in (0, 1):
        deltas = [c for e in events for c in e["choices"] if c["index"] == index]
        pieces = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        assert deltas[-1]["finish_reason"] == "tool_calls" and pieces[0]["function"]["name"] == "get_weather"
        assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Paris", "unit": "celsius"}
    heads = [t["id"] for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or [] if "id" in t]
    assert len(heads) == 2 and len(set(heads)) == 2


def test_smollm2_under_auto_and_a_response_format_calls_or_answers_in_the_schema(smollm2_dir: Path) -> None:
    """The router's prompt and guide for tools + ``response_format``, run on the SmolLM2 engine at
    temperature 0.8 over 8 seeds (and greedy): every reply reads as calls that satisfy their schema
    or as content that is JSON in the reply's schema."""
    cfg = RouterConfig(spec=RouterSpec(port=1), model_name="smollm2", engine_dir=smollm2_dir,
                       groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")])  # fmt: skip
    pool = ScriptedPool.of(cfg.groups)
    gen = Generator(cfg, pool, RouterMetrics(pool))
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    req = ChatCompletionRequest.model_validate({
        "model": "smollm2", "tools": [WEATHER], "response_format": schema, "max_tokens": 120,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    })  # fmt: skip
    prompt, base = gen.chat_prompt(req), gen.sampling(req)
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=128))
    runs = [replace(base, temperature=0.0)] + [replace(base, temperature=0.8, seed=s) for s in range(8)]
    rids = [engine.add_request(prompt, params) for params in runs]  # batched
    while engine.has_unfinished():
        engine.step()
    kinds: list[str] = []
    assert engine.tokenizer is not None
    for rid in rids:
        done = engine.request(rid)
        content, calls = read(ToolFormat.HERMES, [engine.tokenizer.decode(list(done.output_ids))])
        if done.finish_reason is FinishReason.LENGTH:  # cut by max_tokens: a prefix, nothing to parse
            kinds.append("cut")
        elif calls:
            assert all(c["name"] == "get_weather" and json.loads(c["arguments"])["city"] for c in calls), calls
            kinds.append("call")
        else:
            value = json.loads(content)
            assert set(value) == {"answer", "confidence"} and isinstance(value["answer"], str), value
            kinds.append("reply")
    assert kinds.count("cut") <= len(runs) // 2, kinds

"""How this model is asked for tool calls and how its calls are read (``tool_choice: auto``).

``tool_style`` picks the format from the chat template (or from ``router.tool_parser``):

- a template that writes ``<tool_call>`` (Qwen 2.5 / 3, Hermes 2 Pro / 3, ...): ``HERMES``;
- one that writes ``[TOOL_CALLS]`` (Mistral's v3 tokenizers): ``MISTRAL``;
- one that writes ``<|python_tag|>`` or asks for ``"parameters"`` JSON (Llama 3.1-3.3): ``LLAMA3_JSON``;
- any other (SmolLM2's has no tool format): ``HERMES``, not native — the router lists the tools in a
  system turn and asks for that format (as vLLM's and llguidance's "prompt injection" templates do).

A native template gets the tools (``tools=``) and the history's calls and tool turns as the structured
messages Hugging Face templates take; otherwise calls in the history are written in the format asked
for. Under ``HERMES`` (native or not) and ``LLAMA3_JSON`` the reply is free text until the model opens
a call; from there the grammar (``auto_guide``: llguidance's lazy lexemes) holds the call to one of the
functions and its arguments to that function's schema; with a ``response_format`` beside the tools
the reply is calls only or a JSON value in that format's schema. ``MISTRAL`` opens calls with a
special token, so its calls are read, not enforced (and a ``response_format`` beside them is refused).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from frontend.api_guided import Tool, json_or_text, tool_call_schema
from frontend.api_types import ChatMessage
from frontend.tool_reader import HERMES_CLOSE, HERMES_OPEN, ToolFormat
from torch_engine.guided import JSON_OPTIONS, Guide, GuideKind

ToolParser = Literal["auto", "hermes", "llama3_json", "mistral"]
_PARSERS: dict[str, ToolFormat] = {
    "hermes": ToolFormat.HERMES, "llama3_json": ToolFormat.LLAMA3_JSON, "mistral": ToolFormat.MISTRAL,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ToolStyle:
    fmt: ToolFormat
    native: bool  # the chat template renders the tools itself (else the router's system turn lists them)

    @property
    def name(self) -> str:
        return f"{self.fmt.name.lower()} ({'the chat template' if self.native else 'listed by the router'})"


def tool_style(parser: ToolParser, template: str | None) -> ToolStyle:
    t = template or ""
    if parser != "auto":
        return ToolStyle(_PARSERS[parser], native="tools" in t)
    if HERMES_OPEN in t:
        return ToolStyle(ToolFormat.HERMES, native=True)
    if "[TOOL_CALLS]" in t:
        return ToolStyle(ToolFormat.MISTRAL, native=True)
    if "<|python_tag|>" in t or '"parameters": dictionary' in t:
        return ToolStyle(ToolFormat.LLAMA3_JSON, native=True)
    return ToolStyle(ToolFormat.HERMES, native=False)


def listed(tools: list[Tool]) -> str:
    return json.dumps([t.function.model_dump(exclude_none=True) for t in tools])


def instruction(tools: list[Tool], fmt: ToolFormat) -> str:
    """The system turn that lists the tools: a forced call (``JSON``) or a call the model may make."""
    if fmt is ToolFormat.JSON:
        shape = '{"name": ..., "arguments": ...}'
        return f"Call one of these functions: {listed(tools)}. Reply with a JSON object {shape}."
    return (
        f"You may call these functions: {listed(tools)}. To call one, reply with {HERMES_OPEN}\n"
        f'{{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}}\n{HERMES_CLOSE}\n'
        "Otherwise answer directly."
    )


def messages_for(
    req_messages: list[ChatMessage], tools: list[Tool], fmt: ToolFormat | None, native: bool
) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: ``fmt`` is how this request's calls are read
    (None: no tools in play); with a native template, calls and tool turns stay structured."""
    out: list[dict[str, Any]] = []
    for m in req_messages:
        role = "system" if m.role == "developer" else m.role
        if native and m.tool_calls:
            fns = [{"name": c.function.name, "arguments": json_or_text(c.function.arguments)} for c in m.tool_calls]
            calls = [{"type": "function", "function": f} for f in fns]
            out.append({"role": role, "content": m.text() if m.content else "", "tool_calls": calls})
        elif native and m.role == "tool":
            out.append({"role": "tool", "content": m.text(), "tool_call_id": m.tool_call_id or ""})
        else:
            out.append({"role": role, "content": m.text(wrap=fmt is ToolFormat.HERMES)})
    if tools and not native and fmt is not None:
        note = instruction(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def auto_guide(
    tools: list[Tool], fmt: ToolFormat, reply: dict[str, Any] | None = None, parallel: bool = True
) -> Guide | None:
    """The grammar of a reply that may call ``tools``: free text until a call opens, then one of the
    functions with arguments that satisfy its schema; with ``reply`` (``response_format``'s schema),
    either calls only or a JSON value that satisfies ``reply``; not ``parallel``: at most one call,
    and the reply ends with it (None: ``fmt``'s calls are not enforced)."""
    args = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    schema = {**tool_call_schema(tools, args), "x-guidance": dict(JSON_OPTIONS)}
    body = f"body: %json {json.dumps(schema)}\n"
    answer = f"reply: %json {json.dumps({**reply, 'x-guidance': dict(JSON_OPTIONS)})}\n" if reply is not None else ""
    call = f'"\\n" body "\\n{HERMES_CLOSE}"'
    if fmt is ToolFormat.HERMES and reply is None:
        text = "TEXT: /(.|\\n)*/\n"
        start = "start: call* TEXT\n" if parallel else "start: TEXT | call\n"
        grammar = start + text + f"head[lazy]: TEXT {json.dumps(HERMES_OPEN)}\ncall: head {call}\n"
    elif fmt is ToolFormat.HERMES:
        grammar = f'start: {"call+" if parallel else "call"} | reply\ncall: {json.dumps(HERMES_OPEN)} {call} "\\n"?\n'
    elif fmt is ToolFormat.LLAMA3_JSON:
        text = "TEXT?" if reply is None else "reply"
        calls = 'body ("; " body)*' if parallel else "body"
        grammar = f"start: {text} | {calls}\nTEXT: /[^{{](.|\\n)*/\n"
    else:
        return None
    return Guide(GuideKind.LARK, grammar + body + answer)

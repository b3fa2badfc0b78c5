"""The router's response bodies: OpenAI's chunks and choices built from what a request produced
(``Delta`` s and its ``Outcome``): the finish reason, a forced tool call read back from the JSON the
grammar wrote, the legacy completions' log-probability lists."""

from __future__ import annotations

import json
from typing import Literal

from frontend.api_guided import FunctionCall
from frontend.api_types import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    ToolCall,
)
from frontend.generation import Outcome


def tool_call(req: ChatCompletionRequest, text: str, outcome: Outcome, call_id: str) -> ToolCall | None:
    """A forced tool call's JSON (the grammar wrote it) as OpenAI's ``tool_calls`` entry; None when no
    call was forced, or the text was cut by ``max_tokens`` (it stays content, ``finish_reason: length``)."""
    if not req.called or outcome.finish_reason == "length":
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ToolCall(id=call_id, function=FunctionCall(name=value["name"], arguments=json.dumps(value.get("arguments"))))


def reason_of(outcome: Outcome) -> Literal["stop", "length"]:
    return "length" if outcome.finish_reason == "length" else "stop"


def chat_chunk(
    rid: str, created: int, model: str, delta: ChatDelta, reason: Literal["stop", "length", "tool_calls"] | None = None,
    logprobs: ChatLogprobs | None = None,
) -> ChatCompletionChunk:  # fmt: skip
    choice = ChatChunkChoice(delta=delta, finish_reason=reason, logprobs=logprobs)
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])


def completion_chunk(
    rid: str, created: int, model: str, text: str, reason: Literal["stop", "length"] | None,
    logprobs: CompletionLogprobs | None = None,
) -> Completion:  # fmt: skip
    choice = CompletionChoice(text=text, finish_reason=reason, logprobs=logprobs)
    return Completion(id=rid, created=created, model=model, choices=[choice])


def completion_logprobs(
    req: CompletionRequest, lps: list[TokenLogprob], start: int, prompt: list[TokenLogprob | None] | None = None,
    first: str = "",
) -> CompletionLogprobs | None:  # fmt: skip
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}; ``text_offset``
    counts characters of the prompt + completion text (the completion's tokens from ``start``, the
    prompt's length); with ``echo`` the prompt's tokens come first (the first one, ``first``, without a
    log-probability)."""
    if req.logprobs is None:
        return None
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = 0
    for lp in prompt or []:
        token = lp.token if lp is not None else first
        tokens.append(token)
        values.append(lp.logprob if lp is not None else None)
        tops.append({t.token: t.logprob for t in lp.top_logprobs} if lp is not None else None)
        offsets.append(at)
        at += len(token)
    at = start
    for lp in lps:
        tokens.append(lp.token)
        values.append(lp.logprob)
        tops.append({t.token: t.logprob for t in lp.top_logprobs})
        offsets.append(at)
        at += len(lp.token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=values, top_logprobs=tops if req.logprobs else None, text_offset=offsets
    )

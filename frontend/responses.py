"""The router's response bodies: OpenAI's chunks and choices built from what a request produced
(``Delta`` s and its ``Outcome``): the finish reason, a forced tool call read back from the JSON the
grammar wrote, the legacy completions' log-probability lists."""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel

from frontend.api_guided import FunctionCall
from frontend.api_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    StreamedToolCall,
    TokenLogprob,
    ToolCall,
    Usage,
)
from frontend.choices import Ran
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


Reason = Literal["stop", "length"]


def reason_of(outcome: Outcome) -> Reason:
    return "length" if outcome.finish_reason == "length" else "stop"


def chat_chunk(
    rid: str, created: int, model: str, delta: ChatDelta, reason: Literal["stop", "length", "tool_calls"] | None = None,
    logprobs: ChatLogprobs | None = None, index: int = 0,
) -> ChatCompletionChunk:  # fmt: skip
    choice = ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])


def completion_chunk(
    rid: str, created: int, model: str, text: str, reason: Literal["stop", "length"] | None,
    logprobs: CompletionLogprobs | None = None, index: int = 0,
) -> Completion:  # fmt: skip
    choice = CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=logprobs)
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


def usage_of(outcomes: list[Outcome], n: int, scores_only: bool) -> Usage:
    """A request's usage over its choices (``n`` per prompt, in order): each prompt counted once (and its
    cached tokens: those of its first choice), every choice's completion tokens (none when scoring)."""
    leads = outcomes[::n]
    prompt = sum(o.prompt_tokens for o in leads)
    completed = 0 if scores_only else sum(o.completion_tokens for o in outcomes)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completed, total_tokens=prompt + completed,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.cached_tokens for o in leads)),
    )  # fmt: skip


def tool_call_events(
    req: ChatCompletionRequest, choice: ChatChoice, outcome: Outcome, rid: str
) -> list[BaseModel | str]:
    """A forced tool call's stream, as OpenAI streams one: the role, the whole call in one delta, the end."""
    created, message = int(time.time()), choice.message
    calls = [StreamedToolCall(index=0, **c.model_dump()) for c in message.tool_calls or []]
    events: list[BaseModel | str] = [
        chat_chunk(rid, created, req.model, ChatDelta(role="assistant", content="")),
        chat_chunk(
            rid, created, req.model, ChatDelta(content=message.content, tool_calls=calls or None), choice.finish_reason
        ),
    ]
    if req.include_usage:
        events.append(ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[], usage=outcome.usage))
    return [*events, "[DONE]"]


def chat_choice(req: ChatCompletionRequest, index: int, r: Ran, call_id: str) -> ChatChoice:
    """One chat choice: its text, or the tool call the grammar wrote (``finish_reason: tool_calls``)."""
    text = "".join(d.text for d in r.deltas)
    lps = [lp for d in r.deltas for lp in d.logprobs]
    logprobs = ChatLogprobs(content=lps) if req.num_top_logprobs is not None else None
    call = tool_call(req, text, r.outcome, call_id)
    if call is not None:
        message = ChatResponseMessage(content=None, tool_calls=[call])
        return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason="tool_calls")
    message = ChatResponseMessage(content=text)
    return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason_of(r.outcome))


def completion_choice(req: CompletionRequest, index: int, r: Ran, prompt_text: str, first: str) -> CompletionChoice:
    """One completion choice; with ``echo`` its text starts with the prompt (``prompt_text``) and its
    log-probabilities with the prompt's (the first token, ``first``, has none); ``max_tokens: 0`` keeps
    the prompt only."""
    text = "" if req.scores_only else "".join(d.text for d in r.deltas)
    lps = [] if req.scores_only else [lp for d in r.deltas for lp in d.logprobs]
    prompt_lps = next((d.prompt for d in r.deltas if d.prompt), []) if req.echo else []
    logprobs = completion_logprobs(req, lps, len(prompt_text), prompt_lps, first)
    text = (prompt_text if req.echo else "") + text
    return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason_of(r.outcome))

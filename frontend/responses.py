"""The router's response bodies: OpenAI's chunks and choices built from what a request produced
(``Delta`` s and its ``Outcome``): the finish reason, the chat message (``ChatReply``), the legacy
completions' log-probability lists."""

from __future__ import annotations

from typing import Literal

from frontend.api_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    TokenLogprob,
    Usage,
)
from frontend.chat_reply import ChatReply
from frontend.choices import Ran
from frontend.generation import Outcome

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


def chat_choice(req: ChatCompletionRequest, index: int, r: Ran, reply: ChatReply) -> ChatChoice:
    """One chat choice: its text, or its content and the tool calls read from it (``finish_reason:
    tool_calls``)."""
    text = "".join(d.text for d in r.deltas)
    lps = [lp for d in r.deltas for lp in d.logprobs]
    logprobs = ChatLogprobs(content=lps) if req.num_top_logprobs is not None else None
    message, finish = reply.message(text), reply.reason(r.outcome)
    return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish)


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

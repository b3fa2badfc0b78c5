"""One OpenAI request through the decode groups: prompt -> token ids -> pieces (with one retry
on another group before the first token) -> text, usage, finish reason and log-probabilities.

A group that fails in transport, sheds the request (overloaded) or is found hung by the probes
(``GroupPool``) before the first token: the request is tried once more elsewhere; after it, the
stream ends with an error. Shed everywhere: 503 with ``Retry-After``.

Errors are values of ``ApiError`` (HTTP status, OpenAI error type and code); the server turns
them into OpenAI's JSON error shape, or an error event once a stream has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from jinja2 import TemplateError

from frontend import upstream
from frontend.api_guided import schema_guide
from frontend.api_types import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from frontend.config import RouterConfig
from frontend.groups import Group, GroupPool
from frontend.metrics import RouterMetrics
from frontend.text import StopCutter, TextAssembler
from frontend.tool_format import auto_guide, messages_for, tool_style
from frontend.tool_reader import ToolFormat
from frontend.upstream import GroupUnavailable, Overloaded, Piece, Refused
from serving.codecs import check_sampling
from torch_engine.guided import Guide, GuideError, check_guide
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.tokenizer import Tokenizer


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after: float | None = None  # seconds: sent as Retry-After (429 / 503 when shedding load)


SHED_RETRY_AFTER_S = 1.0  # Retry-After when every group tried shed the request


async def until_hung(pieces: AsyncGenerator[Piece, None], group: Group) -> AsyncGenerator[Piece, None]:
    """``pieces`` until ``group`` is found hung (``Group.hung``): then ``GroupUnavailable``, the call cancelled."""
    hung = group.hung
    gone = asyncio.ensure_future(hung.wait())
    nxt: asyncio.Future[Piece] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(anext(pieces))
            await asyncio.wait((nxt, gone), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise GroupUnavailable(f"given up on a hung group: {group.why_down}")
            try:
                piece = nxt.result()
            except StopAsyncIteration:
                return
            yield piece
    finally:
        gone.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
        await pieces.aclose()


@dataclass(slots=True)
class Delta:
    """What one piece added: text (stop strings cut), the new tokens' log-probabilities and, on the
    first, the prompt's when asked for (one per prompt token, the first None)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt: list[TokenLogprob | None] = field(default_factory=list)


@dataclass(slots=True)
class Outcome:
    """Filled in as the request runs; final once the stream ends."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, reused from the serving group's prefix cache
    finish_reason: str | None = None
    group: str | None = None

    @property
    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        return Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, total_tokens=total,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )  # fmt: skip


class Generator:
    def __init__(self, cfg: RouterConfig, pool: GroupPool, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.tokenizer = Tokenizer(cfg.engine_dir)
        self.tool_style = tool_style(cfg.spec.tool_parser, getattr(self.tokenizer.hf, "chat_template", None))
        self._ids = itertools.count()

    def request_id(self, prefix: str) -> str:
        return f"{prefix}-{time.time_ns():x}{next(self._ids):x}"

    # -- prompts -------------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The conversation through the chat template, with the tools as this model takes them
        (``tool_format``): forced calls get a system turn that lists the tools and the JSON a call is
        written as (the grammar then enforces it); ``auto`` the template's own tool format, or a system
        turn asking for ``<tool_call>`` blocks."""
        fmt = self.tool_format(req)
        native = fmt is not None and fmt is not ToolFormat.JSON and self.tool_style.native
        tools = req.called or (req.tools or [] if req.auto_tools else [])
        messages = messages_for(req.messages, tools, fmt, native)
        given = [t.model_dump(exclude_none=True) for t in tools] if native else None
        try:
            return self.tokenizer.encode_chat(messages, given)
        except ValueError as exc:  # no chat template
            raise ApiError(400, f"{exc}: use /v1/completions", param="messages") from None
        except TemplateError as exc:  # the template refused the conversation (roles out of order, ...)
            raise ApiError(400, f"the chat template refused the messages: {exc}", param="messages") from None

    def tool_format(self, req: ChatCompletionRequest) -> ToolFormat | None:
        """How this request's reply is read for calls (None: it makes none)."""
        if req.called:
            return ToolFormat.JSON
        return self.tool_style.fmt if req.auto_tools else None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids (a string is tokenized; ids are checked against the vocabulary)."""
        out = []
        for p in req.prompts:
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p))
                continue
            vocab = len(self.tokenizer.hf)
            bad = next((t for t in p if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            out.append([int(t) for t in p])
        return out

    def sampling(self, req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        limit = req.limit if req.limit is not None else self.cfg.spec.max_tokens_default
        if limit > self.cfg.max_tokens_limit:
            raise ApiError(
                400, f"max_tokens must be at most {self.cfg.max_tokens_limit}, got {limit}", param="max_tokens"
            )
        guided = req.guided
        if guided is None and isinstance(req, ChatCompletionRequest) and req.auto_tools:
            guided = self._auto_guide(req)
        params = SamplingParams(
            max_tokens=limit, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            stop=req.stops, ignore_eos=req.ignore_eos, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logprobs=req.num_top_logprobs, prompt_logprobs=req.num_prompt_logprobs, cache_salt=req.cache_salt,
            guide=guided[1] if guided else None, min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()), logit_bias=req.biases,
        )  # fmt: skip
        try:
            check_sampling(params)  # every value fits the type the wire carries it in; the guide compiles
        except InvalidRequestError as exc:
            if guided and exc.param == "guide":  # named by the client's own field
                raise ApiError(400, f"{guided[0]}: {exc}", param=guided[0]) from None
            raise ApiError(400, str(exc), param=exc.param) from None
        return params

    def _auto_guide(self, req: ChatCompletionRequest) -> tuple[str, Guide] | None:
        """``tool_choice`` 'auto': the tools' grammar, holding a reply without calls to ``response_format``."""
        reply = req.response_format.reply_schema if req.response_format is not None else None
        if reply is not None:
            try:
                check_guide(schema_guide(reply))  # its own errors name its own field
            except GuideError as exc:
                raise ApiError(400, f"response_format: {exc}", param="response_format") from None
        auto = auto_guide(req.tools or [], self.tool_style.fmt, reply, req.parallel_tool_calls is not False)
        if auto is None and reply is not None:
            raise ApiError(
                400, f"response_format cannot be combined with tool_choice 'auto' under the {self.tool_style.name} "
                "tool format (its calls open with a special token, which a JSON grammar cannot allow)",
                param="response_format",
            )  # fmt: skip
        return ("tools", auto) if auto is not None else None

    # -- running -------------------------------------------------------------------------
    async def pieces(
        self, ids: list[int], s: SamplingParams, rid: str, outcome: Outcome, prefer: str | None = None
    ) -> AsyncGenerator[Piece, None]:
        """Pieces from the least loaded group (``prefer``: that one while it is up); a group that fails
        before the first piece: once more elsewhere."""
        tried: set[str] = set()
        failures: list[str] = []
        shed = False  # a group shed it (overloaded): the answer, if none serves it, says when to come back
        while True:
            picked = self.pool.pick(tried, ids, s.cache_salt, prefer)
            if picked is None:
                downs = "; ".join(failures or [f"{g.name}: {g.why_down}" for g in self.pool.groups if not g.up])
                after = SHED_RETRY_AFTER_S if shed else None
                raise ApiError(
                    503, f"no decode group can serve this request ({downs})", "server_error", retry_after=after
                )
            group, expected = picked
            tried.add(group.name)
            outcome.group = group.name
            self.metrics.served.labels(group.name).inc()
            got_any = False
            assert group.client is not None
            with self.pool.track(group, len(ids) - expected, s.max_tokens) as ticket:
                try:
                    call = upstream.stream(group.client, ids, s, rid, self.cfg.spec.request_timeout_s, group.headers)
                    async with contextlib.aclosing(until_hung(call, group)) as responses:
                        async for piece in responses:
                            got_any = True
                            ticket.progress(piece.generated)
                            yield piece
                    return
                except (GroupUnavailable, Overloaded) as exc:
                    if isinstance(exc, GroupUnavailable):
                        self.pool.down(group, str(exc))
                    if got_any:
                        message = f"decode group {group.name} failed mid-stream: {exc}"
                        raise ApiError(502, message, "server_error") from None
                    failures.append(f"{group.name}: {exc}")
                    shed = shed or isinstance(exc, Overloaded)
                    if len(tried) >= 2:
                        after = SHED_RETRY_AFTER_S if shed else None
                        message = f"decode groups failed: {'; '.join(failures)}"
                        raise ApiError(503, message, "server_error", retry_after=after) from None
                    self.metrics.retries.inc()
                except Refused as exc:
                    status = 502 if got_any else 400
                    raise ApiError(status, str(exc), "server_error" if got_any else "invalid_request_error") from None

    async def deltas(
        self, ids: list[int], s: SamplingParams, rid: str, outcome: Outcome, prefer: str | None = None
    ) -> AsyncGenerator[Delta, None]:
        text = TextAssembler(self.tokenizer, StopCutter(s.stop))
        last, first = time.monotonic(), True
        async with contextlib.aclosing(self.pieces(ids, s, rid, outcome, prefer)) as pieces:
            async for piece in pieces:
                new = piece.generated - outcome.completion_tokens
                outcome.completion_tokens = piece.generated
                outcome.cached_tokens = piece.cached
                self.metrics.tokens.labels("completion").inc(new)
                delta = Delta(text.push(piece.window, piece.skip), self._logprobs(piece), self._prompt(ids, piece))
                if piece.finish_reason:
                    delta.text += text.finish()
                    outcome.finish_reason = "stop" if text.cutter.hit else piece.finish_reason
                if delta.text:
                    now = time.monotonic()
                    (self.metrics.ttft if first else self.metrics.itl).observe(now - last)
                    first, last = False, now
                if delta.text or delta.logprobs or delta.prompt or piece.finish_reason:
                    yield delta
        self.metrics.tokens.labels("prompt").inc(outcome.prompt_tokens)
        self.metrics.tokens.labels("prompt_cached").inc(outcome.cached_tokens)

    def _logprobs(self, piece: Piece) -> list[TokenLogprob]:
        if not piece.logprobs:
            return []
        new = piece.window[len(piece.window) - len(piece.logprobs) :]
        out = []
        for t, lp, ids, lps in zip(new, piece.logprobs, piece.top_ids, piece.top_logprobs, strict=True):
            alternatives = [self._top(a, b) for a, b in zip(ids, lps, strict=True)]
            out.append(TokenLogprob(**self._top(t, lp).model_dump(), top_logprobs=alternatives))
        return out

    def _prompt(self, ids: list[int], piece: Piece) -> list[TokenLogprob | None]:
        """The prompt's log-probabilities (the first token has none), when the piece carries them."""
        s = piece.prompt
        if s is None or len(s.logprobs) != len(ids) - 1:
            return []
        out: list[TokenLogprob | None] = [None]
        for t, lp, alt_ids, alt_lps in zip(ids[1:], s.logprobs, s.top_ids, s.top_logprobs, strict=True):
            alternatives = [self._top(a, b) for a, b in zip(alt_ids, alt_lps, strict=True)]
            out.append(TokenLogprob(**self._top(t, lp).model_dump(), top_logprobs=alternatives))
        return out

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.decode([token])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

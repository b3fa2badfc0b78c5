"""The router's HTTP server (aiohttp): OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models``, plus ``/health`` (ready while at least one decode group is) and ``/metrics``.

Every error is OpenAI's JSON error shape with its HTTP status: 400 bad input, 401 missing or
wrong API key, 404 unknown model or route, 503 no decode group can serve, 502 a group failed
mid-request. A client's ``X-Request-Id`` is echoed and names the request on the decode node. A
client that disconnects cancels its request on the decode node (handler cancellation is on, and
closing the upstream stream cancels the gRPC call).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from frontend import choices, tokenize
from frontend.admission import Admission
from frontend.api_types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from frontend.chat_reply import ChatReply
from frontend.config import RouterConfig
from frontend.generation import ApiError, Delta, Generator, Outcome
from frontend.groups import GroupPool
from frontend.metrics import RouterMetrics, route_of
from frontend.responses import (
    chat_choice,
    chat_chunk,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    reason_of,
    usage_of,
)
from torch_engine.sampling import SamplingParams

log = logging.getLogger("frontend.server")
R = TypeVar("R", ChatCompletionRequest, CompletionRequest)
REQUEST_ID = "X-Request-Id"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ROLE = ChatDelta(role="assistant", content="")  # a chat stream's first delta (per choice)


def _json(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=model.model_dump_json(), status=status, content_type="application/json", headers=headers)


def _client_request_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id``: honoured in the response and on the decode node, never trusted to be
    unique (each node appends its own counter)."""
    given = request.headers.get(REQUEST_ID)
    if given is None:
        return None
    if not 0 < len(given) <= 128 or not given.isprintable():
        raise ApiError(400, f"{REQUEST_ID} must be 1-128 printable characters", param=REQUEST_ID)
    return given


async def _body(request: web.Request) -> bytes:
    """The raw body; one over the router's limit is OpenAI's 413 (not aiohttp's own text)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.client_max_size
        raise ApiError(413, f"the body is larger than {limit} bytes", code="request_too_large") from None


def _json_body(body: bytes) -> object:
    """JSON is UTF-8 (RFC 8259) whatever the declared charset; every way it can be malformed is a 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None


def error_response(e: ApiError) -> web.Response:
    retry = {"Retry-After": str(math.ceil(e.retry_after))} if e.retry_after is not None else None
    body = ErrorResponse(error=ErrorBody(message=e.message, type=e.type, param=e.param, code=e.code))
    return _json(body, e.status, retry)


def _sse(model: BaseModel | str) -> bytes:
    body = model if isinstance(model, str) else model.model_dump_json(exclude_none=False)
    return f"data: {body}\n\n".encode()


class Router:
    def __init__(self, cfg: RouterConfig, pool: GroupPool | None = None) -> None:
        self.cfg = cfg
        self.pool = pool or GroupPool.of(cfg.groups, cfg.spec, cfg.node_key)
        self.metrics = RouterMetrics(self.pool)
        self.gen = Generator(cfg, self.pool, self.metrics)
        s = cfg.spec
        self.admission = Admission(s.max_in_flight, s.max_queued, s.queue_timeout_s, s.max_per_client)
        self.created = int(time.time())
        self._probe: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.add_routes(tokenize.routes(self.gen, self.cfg.model_name))
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_route)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.pool.open()
        await self.pool.probe(timeout_s=2.0)
        self._probe = asyncio.create_task(self.pool.probe_forever(self.cfg.spec.probe_interval_s))

    async def _stop(self, app: web.Application) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await self.pool.close()

    # -- middleware ----------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away: nginx's 499 in the metrics
            self.metrics.requests.labels(route_of(request), "499").inc()
            raise
        except ApiError as e:
            self.metrics.requests.labels(route_of(request), str(e.status)).inc()
            return error_response(e)
        except web.HTTPNotFound:
            self.metrics.requests.labels(route_of(request), "404").inc()
            return error_response(ApiError(404, f"no route {request.method} {request.path}", code="not_found"))
        except web.HTTPMethodNotAllowed:
            return error_response(ApiError(405, f"{request.method} is not allowed on {request.path}"))
        except web.HTTPException:
            raise  # aiohttp's own answers (none reach here from our routes)
        except Exception as exc:  # a bug of ours: the client gets OpenAI's shape, the server goes on
            log.exception("request %s %s failed", request.method, request.path)
            self.metrics.requests.labels(route_of(request), "500").inc()
            return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.cfg.spec.api_key
        if key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                what = "no API key" if not given else "an incorrect API key"
                raise ApiError(401, f"you provided {what}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        return await handler(request)

    # -- routes --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        groups = {g.name: {"up": g.up, "in_flight": g.in_flight, "why_down": g.why_down} for g in self.pool.groups}
        body = {"status": "ready" if self.pool.ready else "unavailable", "groups": groups}
        return web.json_response(body, status=200 if self.pool.ready else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        return _json(ModelList(data=[ModelCard(id=self.cfg.model_name, created=self.created)]))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.cfg.model_name:
            raise ApiError(404, f"the model '{name}' does not exist", code="model_not_found", param="model")
        return _json(ModelCard(id=self.cfg.model_name, created=self.created))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request, ChatCompletionRequest)  # a slow upload holds no slot
        async with self.admission.slot(request.remote or ""):
            return await self._serve(request, req, [self.gen.chat_prompt(req)], self.gen.request_id("chatcmpl"))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request, CompletionRequest)
        async with self.admission.slot(request.remote or ""):
            return await self._serve(request, req, self.gen.completion_prompts(req), self.gen.request_id("cmpl"))

    async def _parse(self, request: web.Request, kind: type[R]) -> R:
        raw = _json_body(await _body(request))
        try:
            req = kind.model_validate(raw)
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or None
            raise ApiError(400, f"{field or 'request'}: {first['msg']}", param=field) from None
        if req.model != self.cfg.model_name:
            raise ApiError(
                404, f"the model '{req.model}' does not exist; this deployment serves '{self.cfg.model_name}'",
                code="model_not_found", param="model",
            )  # fmt: skip
        return req

    async def _serve(
        self, request: web.Request, req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], rid: str
    ) -> web.StreamResponse:
        if any(not ids for ids in prompts):  # e.g. a prompt of control characters only: nothing to send upstream
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise ApiError(400, "the prompt is empty: it has no tokens", param=param)
        # a guide's check can take 100 ms for a big schema: off the event loop, which every client shares
        guided = req.guided or (isinstance(req, ChatCompletionRequest) and req.auto_tools)
        sampling = await asyncio.to_thread(self.gen.sampling, req) if guided else self.gen.sampling(req)
        traced = _client_request_id(request) or rid  # names the request on the decode node (traces, logs)
        if len(prompts) * req.width == 1:
            outcome = Outcome(prompt_tokens=len(prompts[0]))
            if req.stream:
                deltas = self.gen.deltas(prompts[0], sampling, traced, outcome)
                return await self._stream(request, req, deltas, outcome, rid, traced, prompts[0])
            runs = [choices.Ran(0, await choices.collect(self.gen, prompts[0], sampling, traced, outcome), outcome)]
        elif req.stream:
            return await self._stream_many(request, req, prompts, sampling, rid, traced)
        else:
            scored = dataclasses.replace(sampling, logprobs=sampling.logprobs or 0) if req.width > req.n else sampling
            runs = await choices.run(self.gen, prompts, scored, traced, req.width)
        self.metrics.requests.labels(route_of(request), "200").inc()
        usage = usage_of([r.outcome for r in runs], req.width, getattr(req, "scores_only", False))
        runs = choices.best(runs, req.n, req.width) if req.width > req.n else runs
        now = int(time.time())
        if isinstance(req, ChatCompletionRequest):
            chat = [chat_choice(req, i, r, self._reply(req)) for i, r in enumerate(runs)]
            body: BaseModel = ChatCompletion(id=rid, created=now, model=req.model, choices=chat, usage=usage)
        else:
            texts = [
                completion_choice(req, i, r, self._prompt_text(req.prompts[r.prompt]), self._first(prompts[r.prompt]))
                for i, r in enumerate(runs)
            ]
            body = Completion(id=rid, created=now, model=req.model, choices=texts, usage=usage)
        return _json(body, headers={REQUEST_ID: traced})

    async def _stream_many(
        self, request: web.Request, req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
        s: SamplingParams, rid: str, traced: str,
    ) -> web.StreamResponse:  # fmt: skip
        """Several choices streamed: each chunk carries one choice's delta under its ``index`` (chat: a
        role chunk first, completions with ``echo``: the prompt first); an error before the first byte
        is still an HTTP error."""
        chat, created, n = isinstance(req, ChatCompletionRequest), int(time.time()), req.n
        queue: asyncio.Queue[tuple[int, Delta, Outcome, bool] | None] = asyncio.Queue()
        replies: dict[int, ChatReply] = {}

        def sink(i: int, d: Delta, o: Outcome) -> None:  # whether the choice ended with this delta
            queue.put_nowait((i, d, o, bool(o.finish_reason)))

        task = asyncio.create_task(choices.run(self.gen, prompts, s, traced, n, sink))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        response: web.StreamResponse | None = None
        seen: set[int] = set()
        try:
            while (item := await queue.get()) is not None:
                i, d, o, last = item
                if response is None:
                    response = web.StreamResponse(headers=SSE_HEADERS | {REQUEST_ID: traced})
                    await response.prepare(request)
                if isinstance(req, ChatCompletionRequest):
                    if i not in seen:
                        replies[i] = self._reply(req)
                        await response.write(_sse(chat_chunk(rid, created, req.model, ROLE, index=i)))
                    chunk: BaseModel | None = replies[i].chunk(rid, created, req.model, d.text, o, index=i, last=last)
                else:
                    echo = self._prompt_text(req.prompts[i // n]) if req.echo and i not in seen else ""
                    chunk = completion_chunk(
                        rid, created, req.model, echo + d.text, reason_of(o) if last else None, index=i
                    )
                seen.add(i)
                if chunk is not None:
                    await response.write(_sse(chunk))
            runs = await task
        except ApiError as e:
            if response is None:
                raise
            await response.write(_sse(ErrorResponse(error=ErrorBody(message=e.message, type=e.type, code=e.code))))
            await response.write(_sse("[DONE]"))
            return response
        finally:
            if not task.done():
                task.cancel()
        assert response is not None
        if req.include_usage:
            usage = usage_of([r.outcome for r in runs], n, getattr(req, "scores_only", False))
            tail = (ChatCompletionChunk if chat else Completion)(
                id=rid, created=created, model=req.model, choices=[], usage=usage
            )
            await response.write(_sse(tail))
        await response.write(_sse("[DONE]"))
        self.metrics.requests.labels(route_of(request), "200").inc()
        return response

    def _reply(self, req: ChatCompletionRequest) -> ChatReply:
        """A chat choice's reply, reading tool calls when the request may make them."""
        base = self.gen.request_id("")[1:]
        return ChatReply(self.gen.tool_format(req), lambda k: f"call_{base}_{k}")

    def _first(self, ids: list[int]) -> str:
        return self.gen.tokenizer.decode(ids[:1])

    def _prompt_text(self, p: str | list[int]) -> str:
        return p if isinstance(p, str) else self.gen.tokenizer.decode([int(t) for t in p])

    async def _stream(
        self,
        request: web.Request,
        req: ChatCompletionRequest | CompletionRequest,
        deltas: AsyncGenerator[Delta, None],
        outcome: Outcome,
        rid: str,
        traced: str,
        ids: list[int],
    ) -> web.StreamResponse:
        """Server-sent events; the first upstream failure before any byte went out is still an HTTP error."""
        chat, created = isinstance(req, ChatCompletionRequest), int(time.time())
        reply = self._reply(req) if isinstance(req, ChatCompletionRequest) else None
        response: web.StreamResponse | None = None
        prompt_text = "" if chat else self._prompt_text(req.prompts[0])  # type: ignore[union-attr]
        offset, first = len(prompt_text), self.gen.tokenizer.decode(ids[:1])  # text offsets run across chunks

        async def send(payload: BaseModel | str) -> None:
            nonlocal response
            if response is None:
                response = web.StreamResponse(headers=SSE_HEADERS | {REQUEST_ID: traced})
                await response.prepare(request)
            await response.write(_sse(payload))

        async with contextlib.aclosing(deltas) as ds:
            try:
                if chat:
                    await send(chat_chunk(rid, created, req.model, ROLE))
                elif req.echo:  # type: ignore[union-attr]
                    await send(completion_chunk(rid, created, req.model, prompt_text, None))
                continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
                async for d in ds:
                    chunk: ChatCompletionChunk | Completion | None
                    if reply is not None:
                        logprobs = ChatLogprobs(content=d.logprobs) if d.logprobs else None
                        chunk = reply.chunk(rid, created, req.model, d.text, outcome, logprobs)
                        if chunk is None:
                            continue  # held back: it may open a tool call
                    else:
                        reason = reason_of(outcome) if outcome.finish_reason else None
                        prompt = d.prompt if req.echo else []  # type: ignore[union-attr]
                        lps = completion_logprobs(req, d.logprobs, offset, prompt, first)  # type: ignore[arg-type]
                        offset += sum(len(lp.token) for lp in d.logprobs)
                        chunk = completion_chunk(rid, created, req.model, d.text, reason, lps)
                    chunk.usage = outcome.usage if continuous else None
                    await send(chunk)
            except ApiError as e:
                if response is None:
                    raise
                self.metrics.requests.labels(route_of(request), str(e.status)).inc()
                await send(ErrorResponse(error=ErrorBody(message=e.message, type=e.type, code=e.code)))
                await send("[DONE]")
                return response
        if req.include_usage:
            kind = ChatCompletionChunk if chat else Completion
            await send(kind(id=rid, created=created, model=req.model, choices=[], usage=outcome.usage))
        await send("[DONE]")
        self.metrics.requests.labels(route_of(request), "200").inc()
        assert response is not None
        return response


def serve(cfg: RouterConfig) -> None:
    """Run the router until SIGINT / SIGTERM."""
    router = Router(cfg)
    log.info("router on http://%s:%d/v1 over decode groups %s", cfg.host, cfg.spec.port, [g.name for g in cfg.groups])
    web.run_app(router.app(), host=cfg.host, port=cfg.spec.port, handler_cancellation=True, print=None)

"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the deployment's own tokenizer over
HTTP (clients count and build token-id prompts with it; lm-eval's remote tokenizer asks for it).
The same chat template and vocabulary checks as the generation routes; errors in OpenAI's shape
(the server's middleware)."""

from __future__ import annotations

import json
from typing import Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from frontend.api_guided import NamedToolChoice, Tool
from frontend.api_types import ChatCompletionRequest, ChatMessage
from frontend.generation import ApiError, Generator


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.messages is not None:  # the chat route's checks (a named function must be among the tools)
            ChatCompletionRequest(model="m", messages=self.messages, tools=self.tools, tool_choice=self.tool_choice)
        return self


class TokenizeResponse(BaseModel):
    count: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


M = TypeVar("M", bound=BaseModel)
# the special tokens /tokenizer_info names (lm-eval's remote tokenizer reads them)
SPECIAL = ("bos", "eos", "pad", "unk")


async def _read(request: web.Request, kind: type[M]) -> M:
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, f"the body is larger than {request.client_max_size} bytes", code="request_too_large"
        ) from None
    try:
        raw = json.loads(body.decode("utf-8"))
        return kind.model_validate(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid UTF-8 JSON: {type(exc).__name__}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{field or 'request'}: {first['msg']}", param=field) from None


def routes(gen: Generator, model_name: str) -> list[web.RouteDef]:
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model '{name}' does not exist", code="model_not_found", param="model")

    async def tokenize(request: web.Request) -> web.Response:
        req = await _read(request, TokenizeRequest)
        check_model(req.model)
        if req.messages is not None:  # as the chat route renders it, tools included
            chat = ChatCompletionRequest.model_construct(
                model=model_name, messages=req.messages, tools=req.tools, tool_choice=req.tool_choice
            )
            ids = gen.chat_prompt(chat)
        else:
            ids = list(gen.tokenizer.hf.encode(req.prompt or "", add_special_tokens=req.add_special_tokens))
        body = TokenizeResponse(count=len(ids), tokens=ids)
        return web.Response(text=body.model_dump_json(), content_type="application/json")

    async def detokenize(request: web.Request) -> web.Response:
        req = await _read(request, DetokenizeRequest)
        check_model(req.model)
        vocab = len(gen.tokenizer.hf)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        body = DetokenizeResponse(prompt=gen.tokenizer.decode(req.tokens))
        return web.Response(text=body.model_dump_json(), content_type="application/json")

    async def tokenizer_info(request: web.Request) -> web.Response:
        """The tokenizer's configuration (its ``tokenizer_config.json``, as vLLM answers), with its class."""
        hf = gen.tokenizer.hf
        info = {k: v for k, v in hf.init_kwargs.items() if isinstance(v, str | int | float | bool | None)}
        info |= {"tokenizer_class": type(hf).__name__, "chat_template": getattr(hf, "chat_template", None)}
        info |= {f"{k}_token": str(getattr(hf, f"{k}_token")) for k in SPECIAL if getattr(hf, f"{k}_token", None)}
        for local in ("name_or_path", "is_local", "local_files_only", "vocab_file"):  # the server's own paths
            info.pop(local, None)
        return web.json_response(info)

    return [
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/tokenizer_info", tokenizer_info),
    ]

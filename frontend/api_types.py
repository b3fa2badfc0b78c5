"""OpenAI's request and response shapes (the parts we serve), validated with pydantic.

Requests reject unknown fields and out-of-range values with a message that names the field
(OpenAI answers those with HTTP 400 ``invalid_request_error``). A request asks for at most
``MAX_CHOICES`` choices (``n`` per prompt; ``/v1/completions`` takes a list of prompts).

Structured output and tools: ``api_guided.py``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from frontend.api_guided import (
    Guided,
    NamedToolChoice,
    Tool,
    ToolCall,
    json_or_text,
    schema_guide,
    tool_call_schema,
)
from torch_engine.guided import Guide
from torch_engine.sampling import MAX_CACHE_SALT, MAX_LOGIT_BIAS

MAX_CHOICES = 64  # n x prompts of one request
MAX_STOP_CHARS = 1000  # per stop sequence (OpenAI allows 4 of them); matching is linear in the text anyway


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="extension (vLLM): usage on every chunk")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class _Request(Guided):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="extension (vLLM, TensorRT-LLM): 0 is off")
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="extension (vLLM, TensorRT-LLM): 1 is off")
    ignore_eos: bool = Field(default=False, description="extension (vLLM): generate max_tokens tokens")
    min_tokens: int = Field(default=0, ge=0, description="extension (vLLM): no EOS / stop token before this many")
    stop_token_ids: list[int] | None = Field(default=None, max_length=64, description="extension (vLLM)")
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # accepted and ignored (nothing here changes with them; README's router row lists them)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None
    service_tier: str | None = Field(default=None, max_length=32)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CACHE_SALT,
        description="extension (vLLM): only requests with the same salt share cached KV pages",
    )

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
        return n

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value}")
        return bias

    @property
    def biases(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(t), float(v)) for t, v in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {longest}")
        return stop

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, ...: accepted, not used

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self, wrap: bool = False) -> str:
        """What the chat template renders: the content, or an assistant's calls as the JSON it emitted
        (``wrap``: each in ``<tool_call>`` tags, the format a model without its own is asked for)."""
        if self.tool_calls and not self.content:
            calls = [
                json.dumps({"name": c.function.name, "arguments": json_or_text(c.function.arguments)})
                for c in self.tool_calls
            ]
            return "\n".join(f"<tool_call>\n{c}\n</tool_call>" if wrap else c for c in calls)
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call under 'auto' (forced calls are one)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise ValueError("messages must hold at least one message")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and not self.called:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        others = [name for name in super()._guides() if name != "response_format"]
        if self.auto_tools and others:
            raise ValueError(
                f"tool_choice 'auto' cannot be combined with {', '.join(others)} (only with response_format): name "
                "a function or drop the tools"
            )
        return self

    @property
    def auto_tools(self) -> bool:
        """The model may call one of the tools or answer (``tool_choice`` 'auto', the default with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def called(self) -> list[Tool]:
        """The tools a call must be one of (empty: no tool call is forced)."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    def _guides(self) -> dict[str, Guide]:
        found = super()._guides()
        if self.auto_tools:
            found.pop("response_format", None)  # the tools' grammar holds the reply to it (``auto_guide``)
        if self.called:
            found["tool_choice"] = schema_guide(tool_call_schema(self.called))
        return found

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no log-probabilities; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> None:
        return None

    @property
    def width(self) -> int:
        return self.n


Prompt = str | list[int]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, description="0 (with echo): score the prompt only")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, description="generate this many per prompt, return the n best")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> object:
        if not prompt or prompt == "":
            raise ValueError("prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], str | list):
            if len(prompt) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(prompt)}")
            if any(not p for p in prompt):
                raise ValueError("prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo (it scores the prompt only)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.width > self.n and self.stream:
            raise ValueError("best_of above n cannot stream (the best are known only at the end)")
        if len(self.prompts) * self.width > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts)} prompts x {self.width} choices is more than {MAX_CHOICES}")
        return self

    @property
    def width(self) -> int:
        """Choices generated per prompt (``best_of``, else ``n``)."""
        return self.best_of or self.n

    @property
    def prompts(self) -> list[Prompt]:
        """One entry per prompt: a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    @property
    def scores_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt's log-probabilities, no completion."""
        return self.max_tokens == 0

    @property
    def limit(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Prompt log-probabilities: with ``echo`` and ``logprobs`` (as OpenAI's legacy API and vLLM)."""
        return self.logprobs if self.echo else None

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV was reused from a prefix cache, not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class _NoNulls(BaseModel):
    """Serialized without its unset (None) fields, as OpenAI sends tool-call deltas."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_NoNulls):
    name: str | None = None
    arguments: str = ""


class StreamedToolCall(_NoNulls):
    """A piece of a streamed call: the first has its id, type and name; the rest more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[StreamedToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "disagg"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody

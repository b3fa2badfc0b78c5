"""The structured-output and tool parts of OpenAI's request shapes (``api_types`` builds on them).

Structured output: OpenAI's ``response_format`` (``json_schema``, ``json_object``, ``text``), vLLM's
``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar``) and its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, SGLang's ``regex`` / ``ebnf`` / ``json_schema``;
at most one of them per request (``Guided.guided``). ``grammar`` and ``ebnf`` are GBNF (vLLM's and
SGLang's xgrammar dialect); ``structured_outputs.grammar`` starting with ``%llguidance`` is Lark.
Tools: OpenAI's ``tools`` / ``tool_choice``; a forced call is written as the JSON of
``tool_call_schema`` under the grammar.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from torch_engine.guided import Guide, GuideKind


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self

    @property
    def reply_schema(self) -> dict[str, Any] | None:
        """The JSON schema a reply must satisfy (None: free text) — with ``tool_choice`` 'auto', a
        reply that calls no tool."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None:
            return {"type": "object"}
        return self.json_schema.json_schema or {}


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (one of its fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if sum(v is not None for v in (self.json_, self.regex, self.choice, self.grammar)) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar")
        return self

    @property
    def guide(self) -> Guide:
        if self.json_ is not None:
            return schema_guide(self.json_)
        if self.regex is not None:
            return Guide(GuideKind.REGEX, self.regex)
        return _choice_guide(self.choice) if self.choice is not None else _grammar_guide(self.grammar or "")


def _choice_guide(choices: list[str]) -> Guide:
    """One of ``choices`` exactly: a Lark alternation of JSON-quoted literals."""
    return Guide(GuideKind.LARK, "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def _grammar_guide(text: str) -> Guide:
    return Guide(GuideKind.LARK if text.lstrip().startswith("%llguidance") else GuideKind.EBNF, text)


def schema_guide(schema: dict[str, Any] | str) -> Guide:
    return Guide(GuideKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))


def _regex_guide(regex: str) -> Guide:
    return Guide(GuideKind.REGEX, regex)


def _ebnf_guide(text: str) -> Guide:
    return Guide(GuideKind.EBNF, text)


class Guided(BaseModel):
    """The structured-output fields of both routes (``guided``: the one set, as the engine's ``Guide``)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(default=None, description="extension (vLLM)")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="extension (vLLM, older)")
    guided_regex: str | None = Field(default=None, description="extension (vLLM, older)")
    guided_choice: list[str] | None = Field(default=None, min_length=1, description="extension (vLLM, older)")
    guided_grammar: str | None = Field(default=None, description="extension (vLLM, older)")
    regex: str | None = Field(default=None, description="extension (SGLang)")
    ebnf: str | None = Field(default=None, description="extension (SGLang)")
    json_schema: str | None = Field(default=None, description="extension (SGLang): a JSON schema as a string")

    @model_validator(mode="after")
    def _at_most_one(self) -> Guided:
        named = self._guides()
        if len(named) > 1:
            raise ValueError(f"at most one structured-output field per request, got {', '.join(named)}")
        return self

    def _guides(self) -> dict[str, Guide]:
        found: dict[str, Guide] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found["response_format"] = Guide(GuideKind.JSON)
        elif rf is not None and rf.json_schema is not None:
            found["response_format"] = schema_guide(rf.json_schema.json_schema or {})
        if self.structured_outputs is not None:
            found["structured_outputs"] = self.structured_outputs.guide
        makers: list[tuple[str, Any, Any]] = [
            ("guided_json", self.guided_json, schema_guide), ("guided_regex", self.guided_regex, _regex_guide),
            ("guided_choice", self.guided_choice, _choice_guide),
            ("guided_grammar", self.guided_grammar, _grammar_guide),
            ("regex", self.regex, _regex_guide), ("ebnf", self.ebnf, _ebnf_guide),
            ("json_schema", self.json_schema, schema_guide),
        ]  # fmt: skip
        found |= {name: make(value) for name, value, make in makers if value is not None}
        return found

    @property
    def guided(self) -> tuple[str, Guide] | None:
        """(the field that set it, the guide), or None."""
        named = self._guides()
        return next(iter(named.items()), None)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class ToolName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolName


def tool_call_schema(tools: list[Tool], args: str = "arguments") -> dict[str, Any]:
    """The JSON a tool call is written as: ``{"name": <one of the tools>, <args>: <its parameters>}``
    (``args``: "parameters" for Llama 3's format)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                args: t.function.parameters or {"type": "object"},
            },
            "required": ["name", args],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}

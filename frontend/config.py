"""What the router runs with: loaded once from the YAML file the launcher renders, passed down.

``RouterSpec`` is the part a cluster config declares (``router:``); ``RouterConfig`` adds what the
launcher knows at render time (the decode groups' gRPC endpoints, the engine with the tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RouterSpec(_Frozen):
    enabled: bool = Field(default=True, description="start the OpenAI-compatible router with the deployment")
    port: int = Field(default=8080, ge=1, le=65535, description="the router's HTTP port (on the deployment's bind)")
    api_key: str | None = Field(default=None, description="when set, every route but /health needs 'Bearer <key>'")
    served_model_name: str | None = Field(default=None, description="the model id clients send; None: the model's name")
    probe_interval_s: float = Field(default=1.0, gt=0, description="how often each decode group's readiness is probed")
    probe_timeout_s: float = Field(
        default=5.0, gt=0, description="a group that does not answer a probe within this leaves rotation until it does"
    )
    stall_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a group whose serving loop has been in one pass this long and STALL_STEPS times its longest "
        "recent step (or that has been silent to probes this long) is hung: it leaves rotation and the requests "
        "streaming from it are given up (retried elsewhere before the first token, else ended with an error)",
    )
    request_timeout_s: float = Field(default=600.0, gt=0, description="one request, first byte to last token")
    max_tokens_default: int = Field(default=256, ge=1, description="max_tokens when a request sets none")
    max_in_flight: int = Field(default=512, ge=1, description="requests served at once (streams hold theirs)")
    max_queued: int = Field(default=1024, ge=0, description="requests waiting for a slot; beyond: 429 + Retry-After")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="the longest wait for a slot; then 503")
    max_per_client: int | None = Field(default=None, ge=1, description="one client address's requests; None: no limit")
    tool_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        default="auto",
        description="the tool-call format of tool_choice 'auto' (vLLM's --tool-call-parser); auto: read from the chat "
        "template, hermes (asked for in a system turn) when the template has none",
    )


class GroupEndpoint(_Frozen):
    name: str
    grpc_url: str


class RouterConfig(_Frozen):
    spec: RouterSpec = RouterSpec()
    host: str = "127.0.0.1"
    model_name: str
    engine_dir: Path = Field(description="an engine directory with the tokenizer and chat template")
    groups: list[GroupEndpoint] = Field(min_length=1)
    max_tokens_limit: int = Field(default=4096, ge=1, description="the decode nodes' own max_tokens limit")
    node_key: str | None = Field(
        default=None, description="the deployment's secret: sent on every call to a decode node (restricted inference)"
    )

    @classmethod
    def load(cls, path: str | Path) -> RouterConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text(encoding="utf-8")))

    def dump(self, path: Path) -> None:
        """Owner-only (0600, from its creation on): it may carry the API key."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(self.model_dump(mode="json")))

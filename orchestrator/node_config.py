"""What one serving node runs: loaded once from a JSON / YAML file and passed down."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from torch_engine.config import EngineConfig


class NodeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    engine_dir: Path
    device: str = "cpu"
    num_pages: int = Field(default=1024, ge=1)
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    max_prefill_chunk: int = Field(default=512, ge=1)
    num_threads: int | None = Field(default=None, ge=1)
    max_tokens_limit: int = Field(default=4096, ge=1)  # the largest max_tokens a request may ask for
    agent_name: str = "disagg-node"  # NIXL agent name of this node's messenger (prefill role)
    nixl_backend: str = "UCX"

    @classmethod
    def load(cls, path: str | Path) -> NodeConfig:
        text = Path(path).read_text(encoding="utf-8")
        return cls.model_validate(yaml.safe_load(text))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            engine_dir=self.engine_dir,
            device=self.device,
            num_pages=self.num_pages,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_chunk=self.max_prefill_chunk,
            num_threads=self.num_threads,
        )

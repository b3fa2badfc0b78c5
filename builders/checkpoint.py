"""A checkpoint in memory: the model's architecture plus its full (unsharded) tensors in HF names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from builders.errors import BuildError
from torch_engine.config import ModelConfig


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names, full shapes
    save_tokenizer: Callable[[Path], bool]  # writes tokenizer files into a folder; False if there is none
    name: str

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise BuildError(f"checkpoint {self.name!r} lacks tensor {name!r}") from None

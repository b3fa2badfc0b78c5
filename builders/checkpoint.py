"""A checkpoint in memory: the model's architecture plus its full (unsharded) tensors in HF names,
dense or, from a GGUF file built ``as-stored``, kept packed (``torch_engine.quant.Packed``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from builders.errors import BuildError
from torch_engine.config import ModelConfig
from torch_engine.quant import Weight


@dataclass(slots=True)
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, Weight]  # Hugging Face names, full shapes
    save_tokenizer: Callable[[Path], bool]  # writes tokenizer files into a folder; False if there is none
    name: str
    converted: dict[str, float] = field(default_factory=dict)  # a GGUF's formats converted: relative RMS error

    def get(self, name: str) -> Weight:
        try:
            return self.tensors[name]
        except KeyError:
            raise BuildError(f"checkpoint {self.name!r} lacks tensor {name!r}") from None

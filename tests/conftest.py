from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from builders import BuildOptions, build_engine
from tests.helpers import build_tiny, make_tiny_checkpoint
from torch_engine.config import DType

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``tiny(kind)`` -> (HF checkpoint folder, fp32 HF model), made once per session."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(f"ckpt-{kind}"))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def tiny_engine_dir(
    tiny: Callable[[str], tuple[Path, torch.nn.Module]], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``tiny_engine_dir(kind, tp=1, page_size=4)`` -> a built engine directory (cached per arguments)."""
    built: dict[tuple[str, int, int], Path] = {}

    def get(kind: str, tp: int = 1, page_size: int = 4) -> Path:
        key = (kind, tp, page_size)
        if key not in built:
            folder, _ = tiny(kind)
            built[key] = build_tiny(
                folder, tmp_path_factory.mktemp(f"eng-{kind}-tp{tp}-p{page_size}") / "e", tp, page_size
            )
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 built in fp32 (the reference dtype for equality with HF)."""
    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    return build_engine("smollm2", out, BuildOptions(dtype=DType.FLOAT32, page_size=16), progress=False)


@pytest.fixture(scope="session")
def hf_smollm2() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from builders.embedded import smollm2_gguf

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

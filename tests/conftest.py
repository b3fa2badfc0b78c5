from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from builders import BuildOptions, build_engine
from tests import helpers
from tests.helpers import build_tiny, make_mtp_checkpoint, make_tiny_checkpoint
from torch_engine.config import DType, WeightStorage

torch.set_num_threads(2)

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="device of the tests' engines (cuda on a GPU machine)")


def pytest_configure(config: pytest.Config) -> None:
    helpers.PATH.device = str(config.getoption("--device"))


@pytest.fixture(params=["reference", "fast", "graphs"])
def engine_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on each compute path: the reference, prepared (packed) weights, and decode steps
    through the decode-graph buckets (captured CUDA graphs on a GPU, eager buffers on a CPU)."""
    helpers.PATH.fast_cpu = request.param == "fast"
    helpers.PATH.decode_graphs = True if request.param == "graphs" else None
    yield str(request.param)
    helpers.PATH.fast_cpu, helpers.PATH.decode_graphs = False, None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ starts servers, deployments or process groups: marked ``e2e``."""
    for item in items:
        if E2E in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def mtp_tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """``mtp_tiny(kind)`` -> (HF checkpoint folder with a DeepSeek-V3-style MTP layer, fp32 HF model
    with that layer as its last), made once per session."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in made:
            made[kind] = make_mtp_checkpoint(kind, tmp_path_factory.mktemp(f"mtp-ckpt-{kind}") / "ck")
        return made[kind]

    return get


@pytest.fixture(scope="session")
def mtp_engine_dir(
    mtp_tiny: Callable[[str], tuple[Path, torch.nn.Module]], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """``mtp_engine_dir(kind, tp=1)`` -> a built engine directory with the MTP module (cached)."""
    built: dict[tuple[str, int], Path] = {}

    def get(kind: str, tp: int = 1) -> Path:
        if (kind, tp) not in built:
            folder, _ = mtp_tiny(kind)
            built[kind, tp] = build_tiny(folder, tmp_path_factory.mktemp(f"mtp-eng-{kind}-tp{tp}") / "e", tp)
        return built[kind, tp]

    return get


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
    """The embedded SmolLM2 built in fp32 as stored (Q4_1 / Q8_0 kept packed): the reference path dequantises
    it at load, bit-equal to gguf (the reference for equality with HF); the fast CPU path computes with it."""
    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    return build_engine("smollm2", out, BuildOptions(dtype=DType.FLOAT32, page_size=16), progress=False)


@pytest.fixture(scope="session")
def smollm2_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 dequantised to fp32 at build time (the dense GEMM paths' subject)."""
    out = tmp_path_factory.mktemp("smollm2") / "fp32-dense"
    opts = BuildOptions(dtype=DType.FLOAT32, page_size=16, weights=WeightStorage.DENSE)
    return build_engine("smollm2", out, opts, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from builders.embedded import smollm2_gguf

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

"""The engine's CPU kernels (``torch_engine/csrc``), compiled once from source for the CPU at hand.

``make setup`` builds them (``python -m torch_engine.kernels``); an engine on the fast CPU path
loads them with ``cpu_kernels()``, which compiles on first use if the build is missing and
returns None, with a warning, where no compiler is available, so the engine falls back to its
PyTorch ops. The build directory is keyed by the torch version, the compiler flags and the
CPU's instruction-set flags: ``-march=native`` code never runs on a CPU it was not built for.
The first build takes about a minute on two cores; later loads take milliseconds.

A build holds an exclusive ``flock`` on ``build.flock`` in its directory (the kernel drops it when the process
dies): a build that was interrupted (Ctrl-C, a killed test) leaves torch's own ``lock`` file behind, on which every
later load would wait forever; the next builder, holding the flock, knows that file is stale and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from torch_engine.cpu import cpu_info

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).resolve().parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "gemm_bf16.cpp",
        "gemm_quant.cpp",
        "decode_step.cpp",
        "prefill_attention.cpp",
        "row_ops.cpp",
    )
]
HEADERS = sorted((Path(__file__).resolve().parent / "csrc").glob("*.h"))
BUILD_ROOT = Path(__file__).resolve().parent.parent / "build" / "kernels"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]  # at::parallel_for is OpenMP


_MARCH = ["native"]  # the instruction-set level this process builds and loads (use_march)


def _flags(march: str) -> list[str]:
    """CFLAGS for ``-march=march``: another level's instruction set is still tuned for this CPU."""
    if march == "native":
        return CFLAGS
    return [f for f in CFLAGS if not f.startswith("-march")] + [f"-march={march}", "-mtune=native"]


def build_dir(march: str = "native") -> Path:
    texts = [p.read_text(encoding="utf-8") for p in [*SOURCES, *HEADERS]]  # whatever the locale (Triton: ASCII)
    key = "|".join([torch.__version__, *_flags(march), *sorted(cpu_info().flags), *texts])
    return BUILD_ROOT / hashlib.sha256(key.encode()).hexdigest()[:16]


@contextlib.contextmanager
def exclusive_build(out: Path) -> Iterator[None]:
    """Hold ``out``'s build flock (waiting for another process's build to end or die); inside it, torch's
    ``lock`` file can only be one an interrupted build left, and is removed (logged)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "build.flock", "a+b") as f:  # closing it drops the flock
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = out / "lock"
        if stale.exists():
            log.warning("removing %s, left by an interrupted kernel build", stale)
            stale.unlink(missing_ok=True)
        yield


def build(verbose: bool = False, march: str = "native") -> ModuleType:
    from torch.utils.cpp_extension import load

    out = build_dir(march)
    venv_bin = str(Path(sys.executable).parent)  # torch runs `ninja` from PATH; pip installs it next to python
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(p for p in (venv_bin, os.environ.get("PATH")) if p)
    with exclusive_build(out):
        return load(
            name="disagg_cpu_kernels",
            sources=[str(p) for p in SOURCES],
            build_directory=str(out),
            extra_cflags=_flags(march),
            extra_ldflags=["-fopenmp"],
            verbose=verbose,
        )


def use_march(level: str) -> None:
    """Build and load this process's kernels for ``-march=level`` (``x86-64-v3``: what an AVX2-only CPU
    builds) instead of the CPU's own: for tests and benchmarks of another CPU class's code paths. Call it
    before anything loads the kernels (one process holds one build of the extension)."""
    if cpu_kernels.cache_info().currsize:
        raise RuntimeError("the CPU kernels are already loaded in this process")
    _MARCH[0] = level


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or None (logged) where they cannot be built here."""
    try:
        return build(march=_MARCH[0])
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler / ninja, or a failed build
        log.warning("CPU kernels unavailable, using PyTorch ops instead: %s", exc)
        return None


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the engine's CPU kernels (make setup runs this).")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands")
    parser.add_argument("--march", default="native", help="the instruction-set level (x86-64-v3: an AVX2-only CPU's)")
    args = parser.parse_args()
    module = build(verbose=args.verbose, march=args.march)
    print(f"built {module.__name__} in {build_dir(args.march)}")

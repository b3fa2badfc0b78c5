"""Every compiled kernel source builds for every CPU class, not only the one this test runs on.

The engine compiles ``torch_engine/csrc`` with ``-march=native``, so a run on an AVX-512 machine never
compiles the AVX2 or the scalar branches of the headers — and a build that fails on a machine falls back
to PyTorch ops (``cpu_kernels`` logs it). That happened: from 2026-12-02 03:35 to 21:40 ``attention.h``
called ``split()`` / ``unsplit()``, defined only under ``__AVX512F__``, from code every build compiles, so
on AVX2-only CPUs no kernel built at all. Here the sources are built for real for ``x86-64-v3`` (AVX2 +
FMA + F16C: what an AVX2-only CPU builds, into the build cache, which ``tests/e2e/test_avx2_build.py``
shares: whichever runs first builds it) and each is compiled (syntax and templates, no code generated) for
``x86-64`` (the scalar loops) and for ``sapphirerapids`` (AVX-512 F / BW / VL / VNNI / BF16: the branches a build
on an AVX2-only machine, CI's included, never sees).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from torch_engine.kernels import CFLAGS, SOURCES

BUILT = "x86-64-v3"  # compiled and linked, as the engine builds it
CHECKED = ("x86-64", "sapphirerapids")  # syntax and templates only


def _check(source: Path, level: str) -> tuple[str, str]:
    flags = [f for f in CFLAGS if not f.startswith("-march") and f != "-O3"]
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-march={level}", *flags, *includes, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
    return f"{source.name} at -march={level}", "\n".join(errors[:5]) if done.returncode else ""


def _build(level: str) -> tuple[str, str]:
    """The engine's build for `level`, in a child process (one process loads one build of the extension)."""
    cmd = [sys.executable, "-m", "torch_engine.kernels", "--march", level]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
    errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "error" in ln]
    return f"the build at -march={level}", "\n".join(errors[:5] or [done.stderr[-2000:]]) if done.returncode else ""


def test_every_kernel_source_compiles_for_every_cpu_class() -> None:
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here (the engine then runs PyTorch ops)")
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = pool.submit(_build, BUILT)
        checked = pool.map(lambda job: _check(*job), [(source, level) for level in CHECKED for source in SOURCES])
        results = [*checked, built.result()]
    failed = {what: errors for what, errors in results if errors}
    assert not failed, failed

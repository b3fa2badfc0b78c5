"""Every compiled kernel source builds for every CPU class, not only the one this test runs on.

The engine compiles ``torch_engine/csrc`` with ``-march=native``, so a run on an AVX-512 machine never
compiles the AVX2 or the scalar branches of the headers — and a build that fails on a machine falls back
to PyTorch ops (``cpu_kernels`` logs it). That happened: from 2026-12-02 03:35 to 21:40 ``attention.h``
called ``split()`` / ``unsplit()``, defined only under ``__AVX512F__``, from code every build compiles, so
on AVX2-only CPUs no kernel built at all. Here the sources are built for real for ``x86-64-v3`` (AVX2 +
FMA + F16C: what an AVX2-only CPU builds, into the build cache, which ``tests/e2e/test_avx2_build.py``
shares: whichever runs first builds it) and all are compiled together (syntax and templates, no code generated) for
``x86-64`` (the scalar loops) and for ``sapphirerapids`` (AVX-512 F / BW / VL / VNNI / BF16: the branches a build
on an AVX2-only machine, CI's included, never sees). A level whose branches the native build (``make setup``'s,
in the cache) already compiles is not built again: on an AVX2-only CPU the native build is the AVX2 build, and
on a CPU with AVX-512 BF16 + VNNI it holds every AVX-512 branch (a second AVX2 build there took 2-4 minutes).
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

from torch_engine.cpu import cpu_info
from torch_engine.kernels import CFLAGS, SOURCES

AVX512_BRANCHES = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}  # the sources' #if's


def levels(flags: frozenset[str]) -> tuple[str, tuple[str, ...]]:
    """The level built for real (compiled and linked, as the engine builds it) and the levels compiled for
    syntax and templates only, on a CPU with `flags`."""
    built = "x86-64-v3" if "avx512f" in flags else "native"  # an AVX2-only CPU's native build is the AVX2 one
    checked = ("x86-64",) if flags >= AVX512_BRANCHES else ("x86-64", "sapphirerapids")
    return built, checked


def _check(level: str, tmp: Path) -> tuple[str, str]:
    """Every source compiled at once, as one unit (torch's headers, ~40 s of the compiler's time, parsed once
    instead of once per source: names in the sources' anonymous namespaces are unique across them)."""
    unit = tmp / f"all-{level}.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in SOURCES))
    flags = [f for f in CFLAGS if not f.startswith("-march") and f != "-O3"]
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-march={level}", *flags, *includes, str(unit)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
    return f"the sources at -march={level}", "\n".join(errors[:5]) if done.returncode else ""


def _build(level: str) -> tuple[str, str]:
    """The engine's build for `level`, in a child process (one process loads one build of the extension)."""
    cmd = [sys.executable, "-m", "torch_engine.kernels", "--march", level]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
    errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "error" in ln]
    return f"the build at -march={level}", "\n".join(errors[:5] or [done.stderr[-2000:]]) if done.returncode else ""


def test_every_kernel_source_compiles_for_every_cpu_class(tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here (the engine then runs PyTorch ops)")
    level, checks = levels(cpu_info().flags)
    with ThreadPoolExecutor(max_workers=2) as pool:
        built = pool.submit(_build, level)
        checked = pool.map(lambda lv: _check(lv, tmp_path), checks)
        results = [*checked, built.result()]
    failed = {what: errors for what, errors in results if errors}
    assert not failed, failed


def test_the_levels_cover_every_branch_once() -> None:
    avx2_only = frozenset({"avx2", "fma", "f16c"})
    assert levels(avx2_only) == ("native", ("x86-64", "sapphirerapids"))
    assert levels(avx2_only | {"avx512f", "avx512bw", "avx512vl"}) == ("x86-64-v3", ("x86-64", "sapphirerapids"))
    assert levels(avx2_only | AVX512_BRANCHES | {"amx_tile"}) == ("x86-64-v3", ("x86-64",))

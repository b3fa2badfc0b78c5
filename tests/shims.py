"""A header of ``torch_engine/csrc`` compiled again, through a small C entry point in ``tests/csrc``, for each
instruction-set level this CPU can execute: the engine builds its kernels with ``-march=native``, so a test
run would otherwise exercise one path only (``test_int8_kernels``, ``test_attention_paths``)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from torch_engine.cpu import cpu_info
from torch_engine.kernels import CFLAGS

# level -> the CPU flags it needs: x86-64 (the scalar / plain loops), x86-64-v3 (AVX2 + FMA + F16C), native
LEVELS = {"x86-64": set(), "x86-64-v3": {"avx2", "fma", "f16c"}, "native": set()}


def compile_shim(source: Path, level: str, out: Path) -> ctypes.CDLL:
    """``source`` built for ``-march=level`` into ``out`` and loaded."""
    obj, lib = out / f"{source.stem}-{level}.o", out / f"{source.stem}-{level}.so"
    flags = [f for f in CFLAGS if not f.startswith("-march") and f != "-fopenmp"]
    includes = [f"-I{p}" for p in include_paths()]  # attention.h reads c10's BFloat16
    cmd = ["g++", "-std=c++17", "-c", "-fPIC", f"-march={level}", *flags, *includes, str(source), "-o", str(obj)]
    subprocess.run(cmd, check=True)
    # linked without -ffast-math: with it, gcc adds crtfastmath.o, which turns on flush-to-zero for the
    # whole process when the library loads (the router fuzzer's hypothesis then refuses to run)
    subprocess.run(["g++", "-shared", str(obj), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def compile_levels(source: Path, out: Path, path_fn: str) -> dict[str, ctypes.CDLL]:
    """``source`` built for every level this CPU can execute (the test skipped where there is no compiler);
    ``path_fn``, the entry point naming the level's code path, returns a C string."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here (the engine then runs PyTorch ops)")
    have = cpu_info().flags
    levels = [lvl for lvl, needs in LEVELS.items() if needs <= have]
    same = "x86-64-v3" in levels and "avx512f" not in have  # then the native build takes the AVX2 paths
    built = [lvl for lvl in levels if not (same and lvl == "x86-64-v3")]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the compiler runs in its own process
        libs = dict(zip(built, pool.map(lambda lvl: compile_shim(source, lvl, out), built), strict=True))
    if same:
        libs["x86-64-v3"] = libs["native"]  # held to the AVX2 level's expectations, not compiled twice
    for so in libs.values():
        getattr(so, path_fn).restype = ctypes.c_char_p
    return libs

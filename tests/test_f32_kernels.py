"""The dense fp32 GEMM of the compiled decode step (``torch_engine/csrc/f32gemm.h``) on every instruction-set
path this CPU can run: compiled through a small C entry point (``tests/csrc/f32gemm_capi.cpp``) for
``x86-64`` (plain loops), ``x86-64-v3`` (AVX2 + FMA, 8 lanes, 2-row passes) and ``native`` (AVX-512 where
present: 16 lanes, 4-row passes); each checked against a float64 GEMM over every row count up to past two
passes, a bias, accumulation into the output, a column range of groups and an output wider than the GEMM."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from tests.shims import compile_levels
from torch_engine.kernels import cpu_kernels

SHIM = Path(__file__).resolve().parent / "csrc" / "f32gemm_capi.cpp"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    if cpu_kernels() is None:
        pytest.skip("the engine's kernels cannot be built here (no compiler)")
    return compile_levels(SHIM, tmp_path_factory.mktemp("f32gemm"), "f32gemm_path")


def _ptr(a: np.ndarray | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data if a is not None else 0)


def test_every_path_is_the_float64_gemm(paths: dict[str, ctypes.CDLL]) -> None:
    rng = np.random.default_rng(0)
    n, k, ldy = 64, 96, 80
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    names = {level: so.f32gemm_path().decode() for level, so in paths.items()}
    assert names["x86-64"] == "scalar"
    for rows in range(1, 11):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        base = rng.standard_normal((rows, ldy)).astype(np.float32)
        for accumulate, b in ((False, None), (True, bias)):
            want = base.astype(np.float64)
            part = x.astype(np.float64) @ w.astype(np.float64)[16:48].T + (0 if b is None else b[16:48])
            want[:, 16:48] = part + (want[:, 16:48] if accumulate else 0)
            for level, so in paths.items():
                y = base.copy()
                i64 = ctypes.c_int64
                args = (i64(k), _ptr(x), i64(rows), i64(1), i64(3), _ptr(y), i64(ldy), _ptr(b))
                so.f32gemm_gemm(_ptr(w), *args, ctypes.c_int(accumulate))
                err = np.abs(y - want).max() / np.abs(want).max()
                assert err < 1e-6, (level, names[level], rows, accumulate, err)

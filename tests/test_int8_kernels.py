"""The integer kernels (``torch_engine/csrc/qgemm.h``) on every instruction-set path this CPU can run.

The engine builds its kernels for the CPU at hand (``-march=native``), so a test run exercises one
path only. Here the header is compiled again, through a small C entry point
(``tests/csrc/qgemm_capi.cpp``), for each level this CPU can execute: ``x86-64`` (the scalar loops),
``x86-64-v3`` (AVX2 + FMA + F16C: ``vpmaddubsw``) and ``native`` (AVX-512 VNNI where present). Each
must compute the product of the weight and the *quantized* activations — checked against a float64
GEMM over the dequantised weight and the dequantised activations — and all agree with each other.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from builders.quantize import quantize_blocks
from tests.shims import compile_levels
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.kernels import cpu_kernels
from torch_engine.quant import Packed, QuantKind, group

SHIM = Path(__file__).resolve().parent / "csrc" / "qgemm_capi.cpp"
KINDS = list(QuantKind)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    if cpu_kernels() is None:
        pytest.skip("the engine's kernels cannot be built here (no compiler)")
    return compile_levels(SHIM, tmp_path_factory.mktemp("qgemm"), "qgemm_path")


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _weight(kind: QuantKind, n: int, k: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A random weight quantized by gguf, grouped by the engine's kernels; and its dequantised values."""
    rng = np.random.default_rng(seed)
    raw = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    p = from_gguf_blocks(kind, raw, (n, k))
    kernels = cpu_kernels()
    assert kernels is not None
    g = group(p, kernels)
    parts = [g.qs.numpy(), g.d.view(torch.int16).numpy(), g.m.view(torch.int16).numpy()]
    return parts, p.dequantize().double().numpy()


def _run(so: ctypes.CDLL, kind: QuantKind, parts: list[np.ndarray], n: int, x: np.ndarray, bias: np.ndarray | None,
         acc: np.ndarray | None) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:  # fmt: skip
    r, k = x.shape
    q = np.empty((r, k), np.int8)
    dx = np.empty((r, k // 32), np.float32)
    s = np.empty((r, k // 32), np.int32)
    so.qgemm_quantize(_ptr(x), ctypes.c_int64(r), ctypes.c_int64(k), _ptr(q), _ptr(dx), _ptr(s))
    y = acc.copy() if acc is not None else np.zeros((r, n), np.float32)
    qs, d, m = parts
    so.qgemm_gemm(
        ctypes.c_int64(int(kind)), ctypes.c_int64(n), ctypes.c_int64(k), _ptr(qs), _ptr(d),
        _ptr(m) if m.size else ctypes.c_void_p(0), _ptr(q), _ptr(dx), _ptr(s), ctypes.c_int64(r), _ptr(y),
        _ptr(bias) if bias is not None else ctypes.c_void_p(0), ctypes.c_int(acc is not None),
    )  # fmt: skip
    return y, (q, dx, s)


def test_the_paths_this_cpu_runs_are_compiled(paths: dict[str, ctypes.CDLL]) -> None:
    names = {lvl: so.qgemm_path().decode() for lvl, so in paths.items()}
    assert names["x86-64"] == "scalar"
    if "x86-64-v3" in names:
        assert names["x86-64-v3"] == "avx2"
    kernels = cpu_kernels()
    assert kernels is not None and names["native"] == kernels.i8_path()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("n", "k", "rows"), [(48, 64, 1), (200, 320, 3), (37, 96, 9), (64, 128, 16), (80, 64, 20), (40, 64, 40)]
)
def test_every_path_computes_the_product_of_the_quantized_activations(
    paths: dict[str, ctypes.CDLL], kind: QuantKind, n: int, k: int, rows: int
) -> None:
    k = -(-k // kind.block_weights) * kind.block_weights  # Q6_K: whole super-blocks of 256
    parts, w = _weight(kind, n, k, seed=n + rows)
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    x[-1, -32:] = np.float32(3e-39) * rng.standard_normal(32).astype(np.float32)  # subnormals
    bias = rng.standard_normal(n).astype(np.float32)
    acc = rng.standard_normal((rows, n)).astype(np.float32)
    outs = {}
    quants = {}
    for lvl, so in paths.items():
        y, (q, dx, s) = _run(so, kind, parts, n, x, bias, acc)
        quants[lvl] = (q, dx, s)
        assert np.abs(q).max() <= 127 and np.array_equal(q.reshape(rows, -1, 32).sum(-1, dtype=np.int32), s), lvl
        step = dx.astype(np.float64).repeat(32, axis=1)
        xq = q.astype(np.float64) * step
        assert np.all(np.abs(xq - x) <= step / 2 * (1 + 1e-5) + 1e-30), lvl  # round to nearest
        want = acc.astype(np.float64) + xq @ w.T + bias
        scale = np.abs(xq) @ np.abs(w).T + np.abs(acc) + np.abs(bias)
        assert np.all(np.abs(y - want) <= 2e-6 * scale + 1e-6), lvl
        outs[lvl] = y
    first = outs["x86-64"]
    for lvl, y in outs.items():
        assert np.allclose(y, first, rtol=1e-5, atol=1e-5), lvl
    for lvl, got in quants.items():  # every path quantizes the activations the same, bit for bit
        assert all(np.array_equal(a, b) for a, b in zip(got, quants["x86-64"], strict=True)), lvl


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_every_path_takes_q8_0_quants_of_the_full_int8_range(paths: dict[str, ctypes.CDLL], rows: int) -> None:
    """Q8_0 quants from -128 to 127 (gguf never writes -128, but a file may hold it): each path's product within the
    bound (AVX2's sign trick takes |w| as an unsigned byte, so -128 needs no clamp)."""
    n, k = 48, 128
    rng = np.random.default_rng(rows)
    qs = torch.from_numpy(rng.integers(-128, 128, size=(n, k), dtype=np.int8))
    qs[:, 0] = -128
    d = torch.from_numpy(rng.uniform(1e-3, 1e-2, size=(n, k // 32)).astype(np.float16))
    p = Packed(QuantKind.Q8_0, qs, d)
    kernels = cpu_kernels()
    assert kernels is not None
    g = group(p, kernels)
    parts = [g.qs.numpy(), g.d.view(torch.int16).numpy(), g.m.view(torch.int16).numpy()]
    w = p.dequantize().double().numpy()
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for lvl, so in paths.items():
        y, (q, dx, _) = _run(so, QuantKind.Q8_0, parts, n, x, None, None)
        xq = q.astype(np.float64) * dx.astype(np.float64).repeat(32, axis=1)
        assert np.all(np.abs(y - xq @ w.T) <= 2e-6 * (np.abs(xq) @ np.abs(w).T) + 1e-6), lvl


@pytest.mark.parametrize(("n", "k", "rows"), [(48, 64, 1), (37, 96, 9), (64, 128, 16), (80, 64, 20), (40, 64, 40)])
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (QuantKind.Q5_0, QuantKind.Q8_0),
        (QuantKind.Q4_1, QuantKind.Q5_1),
        (QuantKind.IQ4_NL, QuantKind.Q8_0),
        (QuantKind.Q3_K, QuantKind.Q6_K),
    ],
)
def test_every_path_computes_the_same_values_in_two_formats_the_same(
    paths: dict[str, ctypes.CDLL], n: int, k: int, rows: int, src: QuantKind, dst: QuantKind
) -> None:
    """The builder's exact changes of format (Q5_0 -> the Q8_0 blocks ``d * (q - 16)``; Q4_1 -> Q5_1, the 5th bits
    0; IQ4_NL -> the Q8_0 blocks of its table's values; Q3_K -> Q6_K, the quants + 28) keep the integer sums, so the
    SIMD paths' results are bit-identical between them, the scalar loops' within float rounding (on AVX-512 9 rows
    take a 9-row tile, 16 and 20 a 16-row one, 40 the per-group unpacking)."""
    from builders.gguf_convert import _as

    k = -(-k // src.block_weights) * src.block_weights  # Q3_K: whole super-blocks of 256
    rng = np.random.default_rng(n + rows)
    a = from_gguf_blocks(src, quantize_blocks(rng.standard_normal((n, k)).astype(np.float32) * 0.05, src), (n, k))
    kernels = cpu_kernels()
    assert kernels is not None
    parts = {}
    for p in (a, _as(a, dst)):
        g = group(p, kernels)
        parts[p.kind] = [g.qs.numpy(), g.d.view(torch.int16).numpy(), g.m.view(torch.int16).numpy()]
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    for lvl, so in paths.items():
        ya, _ = _run(so, src, parts[src], n, x, None, None)
        yb, _ = _run(so, dst, parts[dst], n, x, None, None)
        if so.qgemm_path() == b"scalar":  # plain loops: -ffast-math may sum a row's blocks in another order
            assert np.allclose(ya, yb, rtol=1e-6, atol=1e-6), lvl
        else:
            assert np.array_equal(ya, yb), lvl


@pytest.mark.parametrize("kind", [QuantKind.Q4_1, QuantKind.Q5_1, QuantKind.Q4_K, QuantKind.Q5_K])
@pytest.mark.parametrize("rows", [8, 16])
def test_rows_side_by_side_and_two_chains_a_row_agree(
    paths: dict[str, ctypes.CDLL], kind: QuantKind, rows: int
) -> None:
    """AVX-512's 8- and 16-row tiles of the kinds with a minimum issue their rows' chains side by side on Intel's
    cores and as two chains a row elsewhere: the integer sums are the same, so the tile this CPU does not take equals
    the product the engine's path computes bit for bit."""
    so = paths["native"]
    if so.qgemm_path() != b"avx512-vnni":
        pytest.skip("no AVX-512 VNNI here")
    n, k = 40, 512
    parts, _ = _weight(kind, n, k, seed=rows)
    x = (np.random.default_rng(rows).standard_normal((rows, k)) * 3).astype(np.float32)
    want, (q, dx, s) = _run(so, kind, parts, n, x, None, None)
    other = np.zeros((rows, n), np.float32)
    qs, d, m = parts
    ran = so.qgemm_gemm_other_tiles(
        ctypes.c_int64(int(kind)), ctypes.c_int64(n), ctypes.c_int64(k), _ptr(qs), _ptr(d), _ptr(m), _ptr(q),
        _ptr(dx), _ptr(s), ctypes.c_int64(rows), _ptr(other),
    )  # fmt: skip
    assert ran == 1
    assert np.array_equal(other, want)

"""The paged decode attention (``torch_engine/csrc/attention.h``) and the causal prefill attention
(``prefill_attention.h``) on every instruction-set path this CPU can run, fp32 pages.

The engine builds its kernels with ``-march=native``, so a test run exercises one path only; an AVX2-only CPU
(whose engine runs fp32) takes ``chunk_avx2``, which an AVX-512 machine never builds. Here the header is
compiled again through a small C entry point (``tests/csrc/attention_capi.cpp``) for ``x86-64`` (plain
loops), ``x86-64-v3`` (AVX2 + FMA) and ``native``, and each must equal a float64 softmax attention over the
same pages — any page layout, head sizes with and without their own build, a chunk's short tail — and its
vector exp within 5e-7 (relative) of float64's. The prefill kernel (``tests/csrc/prefill_capi.cpp``; AVX2 and
AVX-512 only: a plain build has none and the engine runs PyTorch's SDPA) must equal a float64 causal
softmax for chunks starting at the sequence's start and later, at and off its block sizes.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.shims import compile_levels

SHIM = Path(__file__).resolve().parent / "csrc" / "attention_capi.cpp"
PREFILL_SHIM = Path(__file__).resolve().parent / "csrc" / "prefill_capi.cpp"
EXPECTED = {"x86-64": "plain", "x86-64-v3": "avx2"}
PREFILL_EXPECTED = {"x86-64": "none", "x86-64-v3": "avx2"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here (the engine then runs PyTorch ops)")
    out = tmp_path_factory.mktemp("attn")
    libs = compile_levels(SHIM, out)
    for so in libs.values():
        so.attn_path.restype = ctypes.c_char_p
    return libs


@pytest.fixture(scope="module")
def prefill_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here (the engine then runs PyTorch ops)")
    libs = compile_levels(PREFILL_SHIM, tmp_path_factory.mktemp("prefill"))
    for so in libs.values():
        so.prefill_path.restype = ctypes.c_char_p
    return libs


def _p(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def test_each_level_builds_its_own_path(paths: dict[str, ctypes.CDLL]) -> None:
    for level, want in EXPECTED.items():
        if level in paths:
            assert paths[level].attn_path().decode() == want


def test_each_level_builds_its_own_prefill_path(prefill_paths: dict[str, ctypes.CDLL]) -> None:
    for level, want in PREFILL_EXPECTED.items():
        if level in prefill_paths:
            assert prefill_paths[level].prefill_path().decode() == want


@pytest.mark.parametrize("d", [64, 24, 8])
@pytest.mark.parametrize("n", [1, 15, 16, 37, 300])
@pytest.mark.parametrize("hnd", [True, False])
def test_attention_equals_float64_softmax(paths: dict[str, ctypes.CDLL], d: int, n: int, hnd: bool) -> None:
    rng = np.random.default_rng(n * 100 + d)
    h, g, page = 3, 3, 16
    pages = (n + page - 1) // page
    pool_pages = pages + 3
    shape = (pool_pages, h, 2, page, d) if hnd else (pool_pages, page, 2, h, d)
    pool = rng.standard_normal(shape).astype(np.float32)
    row = rng.permutation(pool_pages)[:pages].astype(np.int64)  # pages anywhere in the pool
    q = rng.standard_normal((h * g, d)).astype(np.float32)
    s = pool.strides
    if hnd:  # strides in floats: page, head, kv, token
        page_s, head_s, kv_s, tok_s = (x // 4 for x in (s[0], s[1], s[2], s[3]))
    else:
        page_s, tok_s, kv_s, head_s = (x // 4 for x in (s[0], s[1], s[2], s[3]))
    scale = 1.0 / np.sqrt(d)
    # reference: gather each head's K / V in token order, float64 softmax
    tok = np.arange(n)
    pg, slot = row[tok // page], tok % page
    ref = np.empty((h * g, d))
    for kh in range(h):
        k = (pool[pg, kh, 0, slot] if hnd else pool[pg, slot, 0, kh]).astype(np.float64)
        v = (pool[pg, kh, 1, slot] if hnd else pool[pg, slot, 1, kh]).astype(np.float64)
        for j in range(g):
            sc = k @ q[kh * g + j].astype(np.float64) * scale
            w = np.exp(sc - sc.max())
            ref[kh * g + j] = (w / w.sum()) @ v
    for level, so in paths.items():
        out = np.zeros((h * g, d), dtype=np.float32)
        so.attend_f32(_p(q), _p(pool), ctypes.c_int64(h), ctypes.c_int64(g), ctypes.c_int64(d), _p(row),
                      ctypes.c_int64(n), ctypes.c_int64(page), ctypes.c_int64(page_s), ctypes.c_int64(head_s),
                      ctypes.c_int64(kv_s), ctypes.c_int64(tok_s), ctypes.c_float(scale), _p(out))  # fmt: skip
        err = float(np.abs(out - ref).max())
        assert err < 2e-5, (level, err)


def test_vector_exp_is_accurate(paths: dict[str, ctypes.CDLL]) -> None:
    x = np.concatenate([np.linspace(-87.0, 88.0, 4001), [-100.0, 0.0, 1e-8, -1e-8, 88.5]]).astype(np.float32)
    want = np.exp(x.astype(np.float64)).clip(max=np.finfo(np.float32).max)
    for level, so in paths.items():
        out = np.zeros_like(x)
        so.exp_f32(_p(x), ctypes.c_int64(len(x)), _p(out))
        inside = (x > -87.0) & (x < 88.0)
        rel = np.abs(out[inside] - want[inside]) / want[inside]
        assert float(rel.max()) < 5e-7, (level, float(rel.max()))
        assert np.isfinite(out).all() and (out >= 0).all(), level


@pytest.mark.parametrize(("d", "first", "length"), [
    (64, 0, 100),   # a prompt from its start (SmolLM2's heads)
    (64, 37, 50),   # a later chunk: every earlier key visible, causal inside the chunk
    (128, 5, 33),   # Llama-size heads
    (96, 0, 21),    # a head size without its own build
    (16, 3, 1),     # one token, the smallest head
    (64, 0, 290),   # query blocks of 16 and row tiles that do not divide the rows
])  # fmt: skip
@pytest.mark.parametrize("hnd", [True, False])
def test_prefill_equals_float64_causal_softmax(
    prefill_paths: dict[str, ctypes.CDLL], d: int, first: int, length: int, hnd: bool
) -> None:
    rng = np.random.default_rng(d * 1000 + first * 10 + length)
    h, g, page = 3, 3, 16
    s_len = first + length
    pages = (s_len + page - 1) // page
    pool_pages = pages + 3
    shape = (pool_pages, h, 2, page, d) if hnd else (pool_pages, page, 2, h, d)
    pool = rng.standard_normal(shape).astype(np.float32)
    row = rng.permutation(pool_pages)[:pages].astype(np.int64)
    q = (3 * rng.standard_normal((length, h * g, d))).astype(np.float32)
    st = pool.strides
    if hnd:
        page_s, head_s, kv_s, tok_s = (x // 4 for x in (st[0], st[1], st[2], st[3]))
    else:
        page_s, tok_s, kv_s, head_s = (x // 4 for x in (st[0], st[1], st[2], st[3]))
    scale = 1.0 / np.sqrt(d)
    tok = np.arange(s_len)
    pg, slot = row[tok // page], tok % page
    ref = np.empty((length, h * g, d))
    for kh in range(h):
        k = (pool[pg, kh, 0, slot] if hnd else pool[pg, slot, 0, kh]).astype(np.float64)
        v = (pool[pg, kh, 1, slot] if hnd else pool[pg, slot, 1, kh]).astype(np.float64)
        for j in range(g):
            sc = q[:, kh * g + j].astype(np.float64) @ k.T * scale  # [length, s_len]
            sc[np.arange(s_len)[None, :] > first + np.arange(length)[:, None]] = -np.inf
            w = np.exp(sc - sc.max(axis=1, keepdims=True))
            ref[:, kh * g + j] = (w / w.sum(axis=1, keepdims=True)) @ v
    ran = 0
    for level, so in prefill_paths.items():
        out = np.zeros((length, h * g, d), dtype=np.float32)
        ok = so.prefill_f32(_p(q), _p(pool), _p(row), _p(out), ctypes.c_int64(length), ctypes.c_int64(first),
                            ctypes.c_int64(h * g), ctypes.c_int64(h), ctypes.c_int64(d), ctypes.c_int64(page),
                            ctypes.c_int64(page_s), ctypes.c_int64(head_s), ctypes.c_int64(kv_s),
                            ctypes.c_int64(tok_s), ctypes.c_float(scale))  # fmt: skip
        if not ok:
            assert so.prefill_path().decode() == "none", level
            continue
        ran += 1
        err = float(np.abs(out - ref).max())
        assert err < 2e-5, (level, err)
    assert ran >= 1 or "x86-64-v3" not in prefill_paths

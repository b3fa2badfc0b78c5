"""The paged decode attention (``torch_engine/csrc/attention.h``) and the causal prefill attention
(``prefill_attention.h``) on every instruction-set path this CPU can run, fp32 pages (decode: bf16 pages too).

The engine builds its kernels with ``-march=native``, so a test run exercises one path only; an AVX2-only CPU
(whose engine runs fp32) takes ``chunk_avx2``, which an AVX-512 machine never builds. Here the header is compiled
again through a small C entry point (``tests/csrc/attention_capi.cpp``) for ``x86-64`` (plain loops),
``x86-64-v3`` (AVX2 + FMA) and ``native``, and each must equal a float64 softmax attention over the same pages —
any page layout, fp32 or bf16 pages (the AVX2 kernel reads both in place), head sizes with and without their own
build, a chunk's short tail, query heads per KV head in and off the AVX2 kernel's blocks of 3 — and its vector exp
within 5e-7 (relative) of float64's. The prefill kernel (``tests/csrc/prefill_capi.cpp``; AVX2 and AVX-512 only: a
plain build has none and the engine runs PyTorch's SDPA) must equal a float64 causal softmax for chunks starting
at the sequence's start and later, at and off its block sizes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
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
    return compile_levels(SHIM, tmp_path_factory.mktemp("attn"), "attn_path")


@pytest.fixture(scope="module")
def prefill_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL]:
    return compile_levels(PREFILL_SHIM, tmp_path_factory.mktemp("prefill"), "prefill_path")


H, G, PAGE = 3, 3, 16  # KV heads, query heads per KV head, page size


@dataclass(frozen=True)
class Pages:
    """A fp32 (or bf16: uint16 bits) pool holding one sequence of n tokens on pages anywhere in it (HND or NHD),
    its page row, the pool's strides in values (page, head, kv, token) and each KV head's K / V in token order
    (float64, the values the pool holds)."""

    pool: np.ndarray
    row: np.ndarray
    strides: tuple[int, int, int, int]
    k: list[np.ndarray]
    v: list[np.ndarray]

    @staticmethod
    def make(rng: np.random.Generator, n: int, d: int, hnd: bool, bf16: bool = False) -> Pages:
        pages = (n + PAGE - 1) // PAGE
        shape = (pages + 3, H, 2, PAGE, d) if hnd else (pages + 3, PAGE, 2, H, d)
        pool = rng.standard_normal(shape).astype(np.float32)
        if bf16:  # rounded to nearest even, held as bf16 bits; the references read the rounded values
            bits = pool.view(np.uint32)
            pool = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        row = rng.permutation(pages + 3)[:pages].astype(np.int64)  # pages anywhere in the pool
        s = [x // pool.itemsize for x in pool.strides]
        strides = (s[0], s[1], s[2], s[3]) if hnd else (s[0], s[3], s[2], s[1])
        tok = np.arange(n)
        pg, slot = row[tok // PAGE], tok % PAGE
        vals = (pool.astype(np.uint32) << 16).view(np.float32) if bf16 else pool
        k = [(vals[pg, kh, 0, slot] if hnd else vals[pg, slot, 0, kh]).astype(np.float64) for kh in range(H)]
        v = [(vals[pg, kh, 1, slot] if hnd else vals[pg, slot, 1, kh]).astype(np.float64) for kh in range(H)]
        return Pages(pool, row, strides, k, v)

    def args(self) -> list[ctypes.c_int64]:
        """The page size and strides as the C entry points take them."""
        return [ctypes.c_int64(x) for x in (PAGE, *self.strides)]


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


def _attention_case(paths: dict[str, ctypes.CDLL], d: int, n: int, hnd: bool, g: int, bf16: bool) -> None:
    """Every level's decode attention of H KV heads x g query heads over n tokens equals float64's softmax."""
    rng = np.random.default_rng(n * 100 + d + 7 * g)
    pp = Pages.make(rng, n, d, hnd, bf16)
    q = rng.standard_normal((H * g, d)).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    ref = np.empty((H * g, d))  # float64 softmax over each head's K / V in token order
    for kh in range(H):
        for j in range(g):
            sc = pp.k[kh] @ q[kh * g + j].astype(np.float64) * scale
            w = np.exp(sc - sc.max())
            ref[kh * g + j] = (w / w.sum()) @ pp.v[kh]
    for level, so in paths.items():
        out = np.zeros((H * g, d), dtype=np.float32)
        page, page_s, head_s, kv_s, tok_s = pp.args()
        attend = so.attend_bf16 if bf16 else so.attend_f32
        attend(_p(q), _p(pp.pool), ctypes.c_int64(H), ctypes.c_int64(g), ctypes.c_int64(d), _p(pp.row),
               ctypes.c_int64(n), page, page_s, head_s, kv_s, tok_s, ctypes.c_float(scale), _p(out))  # fmt: skip
        err = float(np.abs(out - ref).max())
        assert err < 2e-5, (level, err)


@pytest.mark.parametrize("d", [64, 24, 8])
@pytest.mark.parametrize("n", [1, 15, 16, 37, 300])
@pytest.mark.parametrize("hnd", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_attention_equals_float64_softmax(paths: dict[str, ctypes.CDLL], d: int, n: int, hnd: bool, bf16: bool) -> None:
    _attention_case(paths, d, n, hnd, G, bf16)


@pytest.mark.parametrize("g", [1, 2, 4, 5, 7])  # blocks of 3 query heads and the 1- and 2-head remainders
@pytest.mark.parametrize(("d", "n"), [(64, 37), (24, 300), (40, 16)])  # 40: 5 vectors of 8 (a block of 4, one alone)
@pytest.mark.parametrize("bf16", [False, True])
def test_attention_of_any_group_size(paths: dict[str, ctypes.CDLL], g: int, d: int, n: int, bf16: bool) -> None:
    _attention_case(paths, d, n, True, g, bf16)


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
    s_len = first + length
    pp = Pages.make(rng, s_len, d, hnd)
    q = (3 * rng.standard_normal((length, H * G, d))).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    ref = np.empty((length, H * G, d))
    for kh in range(H):
        for j in range(G):
            sc = q[:, kh * G + j].astype(np.float64) @ pp.k[kh].T * scale  # [length, s_len]
            sc[np.arange(s_len)[None, :] > first + np.arange(length)[:, None]] = -np.inf
            w = np.exp(sc - sc.max(axis=1, keepdims=True))
            ref[:, kh * G + j] = (w / w.sum(axis=1, keepdims=True)) @ pp.v[kh]
    ran = 0
    for level, so in prefill_paths.items():
        out = np.zeros((length, H * G, d), dtype=np.float32)
        ok = so.prefill_f32(_p(q), _p(pp.pool), _p(pp.row), _p(out), ctypes.c_int64(length), ctypes.c_int64(first),
                            ctypes.c_int64(H * G), ctypes.c_int64(H), ctypes.c_int64(d), *pp.args(),
                            ctypes.c_float(scale))  # fmt: skip
        if not ok:
            assert so.prefill_path().decode() == "none", level
            continue
        ran += 1
        err = float(np.abs(out - ref).max())
        assert err < 2e-5, (level, err)
    assert ran >= 1 or "x86-64-v3" not in prefill_paths

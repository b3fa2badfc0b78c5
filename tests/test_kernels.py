"""The compiled CPU kernels against PyTorch references (skipped, with the reason, where they cannot be built)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_engine.attention import decode_attention
from torch_engine.config import KVLayout
from torch_engine.kernels import cpu_kernels
from torch_engine.kv_cache import KVCacheSpec, PagedKVCache

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels could not be built here (no compiler)")


# (activations, pages): each dtype with its own pages, and an fp32 engine over bf16 pages (EngineConfig.kv_dtype),
# and the reverse
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
         (torch.bfloat16, torch.float32)]  # fmt: skip


def _fp32_view(kv: PagedKVCache) -> PagedKVCache:
    """The same pages read in fp32 (the references: every value the pages hold, as they hold it)."""
    view = PagedKVCache(KVCacheSpec(1, 1, 1, KVLayout.HND, kv.spec.dtype, 1, 1), compute_dtype=torch.float32)
    view.spec, view.pools = kv.spec, kv.pools
    return view


@pytest.mark.parametrize("layout", [KVLayout.HND, KVLayout.NHD])
@pytest.mark.parametrize(("dtype", "pages"), PAIRS)
@pytest.mark.parametrize("head_dim", [64, 24])  # the vector path and the plain loops
@pytest.mark.parametrize("page", [16, 5])  # a chunk a page; chunks that start and end inside pages
def test_paged_decode_attention_equals_gather_and_softmax(
    layout: KVLayout, dtype: torch.dtype, pages: torch.dtype, head_dim: int, page: int
) -> None:
    """Decode rows read from the pages in place equal the gathered pages' softmax attention, in the query's
    dtype; pages of another dtype than the query's read as they hold their values."""
    torch.manual_seed(0)
    kv = PagedKVCache(KVCacheSpec(1, 40, page, layout, pages, kv_heads=3, head_dim=head_dim), compute_dtype=dtype)
    kv.pools[0].copy_(torch.randn(kv.pools[0].shape).to(pages))
    kv.kernels = KERNELS
    width = -(-96 // page)
    table = torch.randint(0, 40, (5, width))
    lens = torch.tensor([1, 17, 50, 96, 33])  # a lone token, page edges, a full table
    q = (3 * torch.randn(5, 9, head_dim)).to(dtype)
    mask = (torch.arange(width * page)[None] < lens[:, None])[:, None, None, :]
    want = decode_attention(q.float(), *_fp32_view(kv).gather_pages_kv(0, table), mask, 0.125)
    got = kv.decode_attention(0, q, table, lens, 0.125)
    assert got is not None and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-3)


@pytest.mark.parametrize("layout", [KVLayout.HND, KVLayout.NHD])
@pytest.mark.parametrize(("dtype", "pages"), PAIRS)
@pytest.mark.parametrize(("head_dim", "kv_heads", "first", "length"), [
    (64, 3, 0, 100),   # a prompt from its start (SmolLM2's heads)
    (64, 3, 37, 50),   # a later chunk: every earlier key visible, causal inside the chunk
    (128, 2, 5, 33),   # Llama-size heads
    (96, 4, 0, 21),    # a head size without its own build, no grouping
    (64, 1, 3, 1),     # one token, every query head on one KV head
])  # fmt: skip
def test_paged_prefill_attention_equals_causal_sdpa(
    layout: KVLayout, dtype: torch.dtype, pages: torch.dtype, head_dim: int, kv_heads: int, first: int, length: int
) -> None:
    """A prefill chunk read in place from scattered pages equals PyTorch's SDPA over the gathered keys with
    the chunk's causal mask (query i sees keys 0 .. first + i)."""
    if KERNELS is None or not KERNELS.prefill_attention_supported():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 + FMA: prefill attention runs PyTorch's SDPA")
    torch.manual_seed(1)
    spec = KVCacheSpec(1, 40, 16, layout, pages, kv_heads=kv_heads, head_dim=head_dim)
    kv = PagedKVCache(spec, compute_dtype=dtype)
    kv.pools[0].copy_(torch.randn(kv.pools[0].shape).to(pages))
    kv.kernels = KERNELS
    table = torch.randperm(40)[: -(-(first + length) // 16)][None]
    q = (3 * torch.randn(length, 3 * kv_heads, head_dim)).to(dtype)
    k, v = _fp32_view(kv).gather_kv(0, table)  # [1, Hkv, pages * 16, D]
    s = first + length
    mask = torch.arange(s)[None, :] <= first + torch.arange(length)[:, None]
    want = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[:, :, :s].float(), v[:, :, :s].float(), attn_mask=mask[None, None],
        scale=0.125, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    got = kv.prefill_attention(0, q, table, first, 0.125)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    assert kv.prefill_attention(0, q[:, :, :24].contiguous(), table, first, 0.125) is None  # 24: not a multiple of 16


@pytest.mark.parametrize("width", [1, 7, 16, 49, 1000, 49152])
def test_argmax_rows_equals_torch_argmax(width: int) -> None:
    """Greedy sampling's argmax: the first index of the largest value (ties, -inf rows, +inf), of the first
    NaN where a row has one, at widths below, at and past a vector and with a tail."""
    assert KERNELS is not None
    torch.manual_seed(width)
    x = torch.randn(12, width)
    x[1] = 0.0  # every value tied: the first
    x[2] = float("-inf")
    if width > 3:
        x[3, width // 2] = x[3, width - 1] = 1e30  # a tie between a vector lane and the tail
        x[4, width // 3] = float("inf")
        x[5, width - 2] = float("nan")
        x[5, width - 1] = float("inf")
        x[6, 1] = x[6, width - 1] = float("nan")  # the first NaN, not the last
    x[7] = torch.randint(0, 3, (width,)).float()  # many ties
    x[8, -1] = float("nan")  # a NaN in the last place (the tail, or the last vector)
    got = KERNELS.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert torch.equal(KERNELS.argmax_rows(x[:0]), x[:0].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype: torch.dtype) -> None:
    assert KERNELS is not None
    x, w = torch.randn(7, 3, 96).to(dtype), (1 + 0.1 * torch.randn(96)).to(dtype)
    want = F.rms_norm(x.float(), (96,), w.float(), 1e-5)
    torch.testing.assert_close(
        KERNELS.rms_norm(x, w, 1e-5).float(), want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2
    )


@pytest.mark.skipif(KERNELS is None or not KERNELS.gemm_bf16_supported(), reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 16])
@pytest.mark.parametrize("k", [64, 6])  # unrolled pairs and the tail
def test_gemm_bf16_equals_linear(rows: int, k: int) -> None:
    assert KERNELS is not None
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, k).bfloat16(), (0.1 * torch.randn(48, k)).bfloat16(), torch.randn(48).bfloat16()
    packed = w.view(3, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(KERNELS.gemm_bf16(x, packed, b, 48).float(), want, atol=2e-2, rtol=1e-2)
    got = KERNELS.gemm_bf16(x, packed, torch.empty(0, dtype=torch.bfloat16), 48).float()
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), atol=2e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="N % 16 == 0"):
        KERNELS.gemm_bf16(x, packed, b, 40)

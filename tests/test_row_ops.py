"""The compiled row kernels of the eager model's rows (``torch_engine/csrc/row_ops.cpp``) against PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_engine.config import KVLayout
from torch_engine.kernels import cpu_kernels
from torch_engine.kv_cache import KVCacheSpec, PagedKVCache
from torch_engine.layers import GatedMLP, apply_rope
from torch_engine.parallel import TPGroup

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels could not be built here (no compiler)")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])  # the vector loops, and a tail past them
def test_silu_mul_is_silu_of_gate_times_up(dtype: torch.dtype, width: int) -> None:
    """One pass in fp32, rounded once: within half a unit of the last place of the fp32 product (bf16: its
    rounding; PyTorch's two bf16 ops round twice)."""
    torch.manual_seed(0)
    x = (3 * torch.randn(37, 2 * width)).to(dtype)
    want = F.silu(x[:, :width].float()) * x[:, width:].float()
    assert KERNELS is not None
    got = KERNELS.silu_mul(x)
    assert got.dtype == dtype and got.shape == (37, width)
    torch.testing.assert_close(got, want.to(dtype), atol=1e-6, rtol=1e-6 if dtype == torch.float32 else 0)


def test_gated_mlp_on_the_kernel_equals_its_torch_ops() -> None:
    torch.manual_seed(1)
    mlp = GatedMLP(64, 96, TPGroup.single())
    x = torch.randn(5, 7, 64)
    want = mlp(x)
    mlp.kernels = KERNELS
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", [KVLayout.HND, KVLayout.NHD])
@pytest.mark.parametrize(("dtype", "pool_dtype"), [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16),
                                                                         (torch.bfloat16, torch.float32)])  # fmt: skip
def test_rope_write_kv_equals_apply_rope_and_write_kv(
    layout: KVLayout, dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """q and k heads rotated in place as ``apply_rope`` in fp32 rotates them (rounded once), K and V stored at
    scattered slots bit for bit as ``write_kv`` stores those values (pages of another dtype: rounded to it as
    ``write_kv`` rounds them); every other slot untouched."""
    torch.manual_seed(2)
    hq, hkv, d, t = 9, 3, 64, 21
    spec = KVCacheSpec(1, 8, 16, layout, pool_dtype, kv_heads=hkv, head_dim=d)
    want_kv, got_kv = PagedKVCache(spec, compute_dtype=dtype), PagedKVCache(spec, compute_dtype=dtype)
    for c in (want_kv, got_kv):
        c.pools[0].fill_(7.0)
    got_kv.kernels = KERNELS
    qkv = torch.randn(t, hq + 2 * hkv, d).to(dtype)
    angle = 40 * torch.rand(t, d // 2)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots = torch.randperm(8 * 16)[:t]
    pages, offsets = slots // 16, slots % 16
    rotated = apply_rope(qkv[:, : hq + hkv].float(), cos.float(), sin.float()).to(dtype)
    want_kv.write_kv(0, rotated[:, hq:], qkv[:, hq + hkv :], pages, offsets)
    got = qkv.clone()
    assert got_kv.rope_write_kv(0, got, hq, cos, sin, pages, offsets)
    exact = 0 if dtype == torch.bfloat16 else 1e-6  # fp32: contraction into FMAs may move the last bit
    torch.testing.assert_close(got[:, : hq + hkv], rotated, atol=exact, rtol=exact)
    torch.testing.assert_close(got[:, hq + hkv :], qkv[:, hq + hkv :], atol=0, rtol=0)  # V untouched
    torch.testing.assert_close(got_kv.pools[0], want_kv.pools[0], atol=exact, rtol=exact)


def test_rope_write_kv_refuses_a_slot_outside_the_pool() -> None:
    spec = KVCacheSpec(1, 4, 16, KVLayout.HND, torch.float32, kv_heads=1, head_dim=8)
    kv = PagedKVCache(spec)
    kv.kernels = KERNELS
    qkv, cs = torch.randn(2, 3, 8), torch.ones(2, 4)
    for pages, offsets in (([0, 4], [0, 1]), ([0, 1], [0, 16]), ([-1, 1], [0, 1])):
        with pytest.raises(RuntimeError, match="outside the pool"):
            kv.rope_write_kv(0, qkv, 1, cs, cs, torch.tensor(pages), torch.tensor(offsets))
    assert not kv.pools[0].any()


def test_rope_write_kv_declines_what_it_does_not_take() -> None:
    """A dtype the kernel does not take (fp16), cos / sin in another dtype than qkv's, or no kernels: False,
    nothing written (the caller's torch ops run)."""
    spec = KVCacheSpec(1, 4, 16, KVLayout.HND, torch.float32, kv_heads=1, head_dim=8)
    kv = PagedKVCache(spec)
    qkv, cs, slot = torch.randn(2, 3, 8), torch.ones(2, 4), torch.tensor([0, 1])
    assert not kv.rope_write_kv(0, qkv, 1, cs, cs, slot, slot)
    kv.kernels = KERNELS
    assert not kv.rope_write_kv(0, qkv.half(), 1, cs.half(), cs.half(), slot, slot)
    assert not kv.rope_write_kv(0, qkv.bfloat16(), 1, cs, cs, slot, slot)
    assert not kv.pools[0].any()

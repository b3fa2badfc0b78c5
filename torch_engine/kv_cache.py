"""Paged KV cache: one pool tensor per layer, its shapes, its reads and writes.

Page shapes (``P`` tokens per page, ``H`` local KV heads, ``D`` head dim, ``L`` MLA latent dim):

- GQA, HND: ``[H, 2, P, D]`` — heads outermost, then K/V, so the slice of a page that one
  tensor-parallel shard owns (a range of heads) is one contiguous byte range.
- GQA, NHD: ``[P, H, 2, D]`` — token-major; a shard's slice is one range per token.
- MLA: ``[P, L]`` — the compressed latent and the rotated rope key of each token (the same
  on every TP rank), for either layout.

Who holds which page: ``pages.PageAllocator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from torch_engine.config import KVLayout

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the compiled kernels' activations and pools, any pair


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one rank's cache. ``kv_heads``/``head_dim`` for GQA; ``latent_dim`` > 0 for MLA."""

    num_layers: int
    num_pages: int
    page_size: int
    layout: KVLayout
    dtype: torch.dtype
    kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.latent_dim > 0

    @property
    def page_shape(self) -> tuple[int, ...]:
        if self.is_mla:
            return (self.page_size, self.latent_dim)
        if self.layout is KVLayout.HND:
            return (self.kv_heads, 2, self.page_size, self.head_dim)
        return (self.page_size, self.kv_heads, 2, self.head_dim)

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class PagedKVCache:
    """The pools (one ``[num_pages, *page_shape]`` tensor per layer) and their reads and writes.

    ``compute_dtype``: the model's activations (default: the pool's dtype). The pages may be held in
    another (an fp32 engine with bf16 pages: ``EngineConfig.kv_dtype``): writes round to the pool's
    dtype, gathers return the compute dtype, and the compiled kernels read the pages as they are.

    ``kernels`` (set by the engine on its fast CPU path): the compiled ``torch_engine/csrc``
    module; GQA decode rows then attend straight from the pages (``decode_attention``)."""

    kernels: ModuleType | None = None

    def __init__(
        self, spec: KVCacheSpec, device: torch.device | str = "cpu", compute_dtype: torch.dtype | None = None
    ) -> None:
        self.spec = spec
        self.compute_dtype = compute_dtype or spec.dtype
        self.pools = [
            torch.zeros((spec.num_pages, *spec.page_shape), dtype=spec.dtype, device=device)
            for _ in range(spec.num_layers)
        ]

    def write_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """Store K and V (``[T, H, D]``) of T tokens at (page, offset) slots."""
        kv = torch.stack((k, v), dim=2).to(self.spec.dtype)  # [T, H, 2, D]
        if self.spec.layout is KVLayout.HND:
            self.pools[layer][pages, :, :, offsets] = kv
        else:
            self.pools[layer][pages, offsets] = kv

    def rope_write_kv(
        self,
        layer: int,
        qkv: torch.Tensor,
        q_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pages: torch.Tensor,
        offsets: torch.Tensor,
    ) -> bool:
        """With the compiled kernels: rotate the query and key heads of ``qkv`` (``[T, q_heads + 2 * H, D]``,
        contiguous, fp32 or bf16) in place with ``cos`` / ``sin`` (``[T, D / 2]``, HF's rotate_half) and
        store each token's K and V at its (page, offset), in one pass. False, nothing done, where the kernel
        does not apply (no kernels, another device or dtype, MLA): the caller rotates and calls ``write_kv``."""
        found = self._kernel_pool(layer, qkv)
        if found is None or not qkv.is_contiguous() or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
            return False
        k, pool, (page, head, kv, token) = found
        kh, ps = self.spec.kv_heads, self.spec.page_size
        k.rope_write_kv(qkv, cos, sin, pool, pages, offsets, q_heads, kh, ps, page, head, kv, token)
        return True

    def gather_kv(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the sequences whose pages are the rows of ``page_table`` (``[B, M]``).

        Returns two ``[B, H, M * page_size, D]`` views of head-major ``[H, B, M * page_size, D]``
        buffers, so that batched matmuls over (head, sequence) use them as they are. With HND
        that is one gather per tensor and no further copy.
        """
        b, m = page_table.shape
        pool = self.pools[layer]
        if self.spec.layout is KVLayout.HND:
            k_pages, v_pages = pool[:, :, 0], pool[:, :, 1]  # [N, H, P, D] views
        else:
            k_pages, v_pages = pool[:, :, :, 0].transpose(1, 2), pool[:, :, :, 1].transpose(1, 2)
        shape = (self.spec.kv_heads, b, m * self.spec.page_size, self.spec.head_dim)
        k = k_pages.transpose(0, 1)[:, page_table].reshape(shape)  # [H, B, M, P, D] -> [H, B, S, D]
        v = v_pages.transpose(0, 1)[:, page_table].reshape(shape)
        return k.transpose(0, 1).to(self.compute_dtype), v.transpose(0, 1).to(self.compute_dtype)

    def gather_pages_kv(self, layer: int, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole pages, page-major: two ``[B, M, H, P, D]`` views of one gather.

        The gather copies whole pages (contiguous blocks). With HND, every (sequence, page,
        head) block is a contiguous ``[P, D]`` matrix, so batched matmuls read them in place.
        """
        b, m = page_table.shape
        g = self.pools[layer].index_select(0, page_table.reshape(-1)).view(b, m, *self.spec.page_shape)
        g = g.to(self.compute_dtype)
        if self.spec.layout is KVLayout.HND:
            return g[:, :, :, 0], g[:, :, :, 1]  # [B, M, H, 2, P, D] -> [B, M, H, P, D]
        return g[..., 0, :].transpose(2, 3), g[..., 1, :].transpose(2, 3)  # [B, M, P, H, 2, D]

    def strides(self, layer: int = 0) -> list[int]:
        """A GQA pool's (page, head, K / V, token) strides, as the compiled kernels take them."""
        st = self.pools[layer].stride()
        if self.spec.layout is KVLayout.HND:  # [N, H, 2, P, D]
            return [st[0], st[1], st[2], st[3]]
        return [st[0], st[2], st[3], st[1]]  # [N, P, H, 2, D]

    def _kernel_pool(self, layer: int, q: torch.Tensor) -> tuple[ModuleType, torch.Tensor, list[int]] | None:
        """The compiled kernels, a layer's pool and its strides (``strides``), if the attention kernels
        apply to ``q`` here (kernels loaded, CPU, not MLA, ``q`` and the pool each fp32 or bf16); else None."""
        pool, k = self.pools[layer], self.kernels
        if k is None or pool.device.type != "cpu" or self.spec.is_mla:
            return None
        if q.dtype not in _KERNEL_DTYPES or pool.dtype not in _KERNEL_DTYPES:
            return None
        return k, pool, self.strides(layer)

    def decode_attention(
        self, layer: int, q: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        """GQA decode rows (``q`` ``[B, Hq, D]``) over their pages with the fused kernel, reading K/V in
        place; None when the kernel does not apply here (no kernels, another device, MLA)."""
        found = self._kernel_pool(layer, q)
        if found is None:
            return None
        k, pool, (page, head, kv, token) = found
        kh, ps = self.spec.kv_heads, self.spec.page_size
        return k.paged_decode_attention(q, pool, page_table, kv_lens, kh, page, head, kv, token, ps, scale)

    def prefill_attention(
        self, layer: int, q: torch.Tensor, page_table: torch.Tensor, first: int, scale: float
    ) -> torch.Tensor | None:
        """A causal prefill chunk (``q`` ``[L, Hq, D]`` at positions ``first..``) over its sequence's pages
        (``page_table`` ``[1, M]``) with the compiled kernel, reading K/V in place; None when it does not
        apply here (no kernels, or neither AVX-512 nor AVX2, another device, MLA, a head size not a multiple of
        16)."""
        found = self._kernel_pool(layer, q)
        if found is None or q.shape[-1] % 16 or q.shape[-1] > 256 or not found[0].prefill_attention_supported():
            return None
        k, pool, (page, head, kv, token) = found
        kh, ps = self.spec.kv_heads, self.spec.page_size
        return k.paged_prefill_attention(q, pool, page_table[0], first, kh, page, head, kv, token, ps, scale)

    def write_latent(self, layer: int, latent: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> None:
        """Store the MLA latent (``[T, L]``) of T tokens."""
        self.pools[layer][pages, offsets] = latent.to(self.spec.dtype)

    def gather_latent(self, layer: int, page_table: torch.Tensor) -> torch.Tensor:
        """``[B, M * page_size, L]`` latents in token order."""
        b, m = page_table.shape
        latents = self.pools[layer][page_table].reshape(b, m * self.spec.page_size, self.spec.latent_dim)
        return latents.to(self.compute_dtype)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages of every layer within this cache, ``(source, destination)`` in order (a
        destination may be a later copy's source)."""
        for src, dst in copies:
            for pool in self.pools:
                pool[dst].copy_(pool[src])

    def copy_pages_from(self, other: PagedKVCache, src_pages: list[int], dst_pages: list[int]) -> None:
        """Copy whole pages of every layer from another cache of the same spec (a local transfer)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
        if other.spec.page_shape != self.spec.page_shape or other.spec.dtype != self.spec.dtype:
            raise ValueError("page layouts differ: cannot copy pages between these caches")
        src = torch.tensor(src_pages, dtype=torch.long)
        dst = torch.tensor(dst_pages, dtype=torch.long)
        for mine, theirs in zip(self.pools, other.pools, strict=True):
            mine[dst.to(mine.device)] = theirs[src.to(theirs.device)].to(mine.device)

"""Model families. ``build_model`` picks the module for a config; ``cache_spec`` sizes its KV pages, ``kv_cache``
makes them."""

from __future__ import annotations

import torch

from torch_engine.config import KVLayout, ModelConfig
from torch_engine.kv_cache import KVCacheSpec, PagedKVCache
from torch_engine.models.decoder import CausalLM
from torch_engine.models.deepseek import deepseek_model
from torch_engine.models.llama import llama_model, local_kv_heads
from torch_engine.parallel import TPGroup


def build_model(cfg: ModelConfig, tp: TPGroup) -> CausalLM:
    return deepseek_model(cfg, tp) if cfg.is_mla else llama_model(cfg, tp)


def cache_spec(
    cfg: ModelConfig, tp_size: int, num_pages: int, page_size: int, layout: KVLayout, dtype: torch.dtype
) -> KVCacheSpec:
    if cfg.is_mla:
        assert cfg.kv_lora_rank is not None
        return KVCacheSpec(
            cfg.num_kv_layers, num_pages, page_size, layout, dtype, latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim
        )
    return KVCacheSpec(
        cfg.num_kv_layers,
        num_pages,
        page_size,
        layout,
        dtype,
        kv_heads=local_kv_heads(cfg, tp_size),
        head_dim=cfg.head_dim,
    )


def kv_cache(
    cfg: ModelConfig, tp_size: int, num_pages: int, page_size: int, layout: KVLayout, kv_dtype: torch.dtype,
    dtype: torch.dtype, device: torch.device,
) -> PagedKVCache:  # fmt: skip
    """A rank's paged KV cache, its pages held in ``kv_dtype`` (``loader.run_kv_dtype``) and read back as
    ``dtype``."""
    return PagedKVCache(cache_spec(cfg, tp_size, num_pages, page_size, layout, kv_dtype), device, dtype)

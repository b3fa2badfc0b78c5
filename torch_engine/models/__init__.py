"""Model families. ``build_model`` picks the module for a config; ``cache_spec`` sizes its KV pages, ``kv_cache``
makes them."""

from __future__ import annotations

import torch

from torch_engine.config import EngineConfig, KVLayout, ModelConfig
from torch_engine.kernels import cpu_kernels
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


def run_kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the KV pages hold: the config's; else the compute ``dtype``, except that ``auto`` on a CPU that
    computes in fp32 with the compiled kernels (AVX2-only, or AVX-512 without BF16) keeps bf16 pages. Those kernels
    read bf16 pages in place (half the bytes a token, in memory and on the wire): on the AVX2-only Zen 3 the batch-16
    step's attention 27.1 ms on fp32 pages -> 18.3 ms, the step 1.04-1.12x at batch 1-16 against the kernels before,
    perplexity within run-to-run noise (BENCHMARKS.md, session 45)."""
    if config.kv_dtype is not None:
        return config.kv_dtype.torch
    if config.dtype != "auto" or device.type != "cpu" or dtype != torch.float32:
        return dtype  # (the kernels are asked for only here: another config must not build them)
    return torch.bfloat16 if cpu_kernels() is not None else dtype


def kv_cache(
    config: EngineConfig, cfg: ModelConfig, tp_size: int, num_pages: int, page_size: int, layout: KVLayout,
    dtype: torch.dtype, device: torch.device,
) -> PagedKVCache:  # fmt: skip
    """A rank's paged KV cache, its pages held in ``run_kv_dtype`` (by default the compute ``dtype``) and read back
    as ``dtype``."""
    kv_dtype = run_kv_dtype(config, dtype, device)
    return PagedKVCache(cache_spec(cfg, tp_size, num_pages, page_size, layout, kv_dtype), device, dtype)

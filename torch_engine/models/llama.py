"""Llama-style decoder with grouped-query attention: Llama 2/3, SmolLM2, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Weights are this rank's shards, in the engine's names (see ``builders/sharding.py``):
``qkv`` is q, k, v fused along the output dim; ``gate_up`` is gate and up fused.
"""

from __future__ import annotations

import torch
from torch import nn

from torch_engine.attention import AttentionMetadata, decode_attention, paged_attention
from torch_engine.config import ModelConfig
from torch_engine.kv_cache import PagedKVCache
from torch_engine.layers import GatedMLP, Linear, RMSNorm, apply_rope
from torch_engine.models.decoder import CausalLM, DecoderLayer
from torch_engine.parallel import TPGroup


def local_kv_heads(cfg: ModelConfig, tp_size: int) -> int:
    """KV heads each rank holds: sharded when TP <= KV heads, one replicated head otherwise."""
    return max(cfg.num_kv_heads // tp_size, 1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.hq = cfg.num_heads // tp.size
        self.hkv = local_kv_heads(cfg, tp.size)
        self.d = cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o = Linear(self.hq * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.d**-0.5
        self.tp = tp

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache, layer: int) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x).view(t, self.hq + 2 * self.hkv, self.d)
        fused = self.q_norm is None and kv.rope_write_kv(
            layer, qkv, self.hq, meta.cos, meta.sin, meta.slot_pages, meta.slot_offsets
        )
        if fused:  # rotated in place, K / V stored
            q = qkv[:, : self.hq]
        else:
            qk, v = qkv[:, : self.hq + self.hkv], qkv[:, self.hq + self.hkv :]
            if self.q_norm is not None and self.k_norm is not None:
                qk = torch.cat((self.q_norm(qk[:, : self.hq]), self.k_norm(qk[:, self.hq :])), dim=1)
            qk = apply_rope(qk, meta.cos, meta.sin)  # q and k heads rotated together
            q, k = qk[:, : self.hq], qk[:, self.hq :]
            kv.write_kv(layer, k, v, meta.slot_pages, meta.slot_offsets)

        def decode(qd: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            lens = meta.decode_kv_lens
            fused = kv.decode_attention(layer, qd, table, lens, self.scale) if lens is not None else None
            return (
                fused
                if fused is not None
                else decode_attention(qd, *kv.gather_pages_kv(layer, table), mask, self.scale)
            )

        def prefill(qp: torch.Tensor, table: torch.Tensor, first: int) -> torch.Tensor | None:
            return kv.prefill_attention(layer, qp, table, first, self.scale)

        out = paged_attention(q, meta, lambda table: kv.gather_kv(layer, table), self.scale, self.d, decode, prefill)
        return self.tp.all_reduce(self.o(out.reshape(t, -1)))


def llama_model(cfg: ModelConfig, tp: TPGroup) -> CausalLM:
    def layer(_: int) -> DecoderLayer:
        return DecoderLayer(
            cfg, LlamaAttention(cfg, tp), GatedMLP(cfg.hidden_size, cfg.intermediate_size // tp.size, tp)
        )

    return CausalLM(cfg, layer, cfg.head_dim, tp.size)

"""DeepSeek-V2/V3 decoder: multi-head latent attention (MLA) and DeepSeek MoE.

The KV cache holds, per token, the compressed latent (after ``kv_a_norm``) and the rotated
rope key: ``kv_lora_rank + qk_rope_head_dim`` values, identical on every TP rank. Attention
expands the gathered latents with ``kv_b`` (column-sharded by head) into per-head K and V.
MoE experts are tensor parallel like a dense MLP (every rank holds a slice of every expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_engine.attention import AttentionMetadata, paged_attention
from torch_engine.config import ModelConfig
from torch_engine.kv_cache import PagedKVCache
from torch_engine.layers import GatedMLP, Linear, RMSNorm, apply_rope, mla_softmax_scale
from torch_engine.models.decoder import CausalLM, DecoderLayer
from torch_engine.parallel import TPGroup


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        assert cfg.kv_lora_rank is not None
        self.h = cfg.num_heads // tp.size
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, self.h * qk, bias=False)
        else:
            self.q_a = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b = Linear(cfg.q_lora_rank, self.h * qk, bias=False)
        self.kv_a = Linear(cfg.hidden_size, self.rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b = Linear(self.rank, self.h * (self.nope + self.vd), bias=False)
        self.o = Linear(self.h * self.vd, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = mla_softmax_scale(cfg)
        self.interleave = cfg.rope_interleave
        self.lora_q = cfg.q_lora_rank is not None
        self.tp = tp

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``[B, S, L]`` -> K ``[B, H, S, qk]`` and V ``[B, H, S, v]``."""
        b, s, _ = latent.shape
        kvb = self.kv_b(latent[..., : self.rank]).view(b, s, self.h, self.nope + self.vd)
        k_nope, v = kvb.split([self.nope, self.vd], dim=-1)
        k_rot = latent[..., self.rank :][:, :, None, :].expand(b, s, self.h, self.rope)
        return torch.cat((k_nope, k_rot), dim=-1).transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache, layer: int) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.lora_q else self.q_proj(x)
        q_nope, q_rot = q.view(t, self.h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv_nope, k_rot = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        q_rot = apply_rope(q_rot, meta.cos, meta.sin, self.interleave)
        k_rot = apply_rope(k_rot[:, None, :], meta.cos, meta.sin, self.interleave)[:, 0]
        kv.write_latent(layer, torch.cat((self.kv_a_norm(kv_nope), k_rot), dim=-1), meta.slot_pages, meta.slot_offsets)
        q = torch.cat((q_nope, q_rot), dim=-1)
        out = paged_attention(q, meta, lambda table: self._expand(kv.gather_latent(layer, table)), self.scale, self.vd)
        return self.tp.all_reduce(self.o(out.reshape(t, -1)))


class MoE(nn.Module):
    """Routed experts + shared experts. V2: softmax scores; V3: sigmoid + correction bias + groups."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size // tp.size
        self.cfg = cfg
        self.router = Linear(cfg.hidden_size, e, bias=False)
        self.router_bias = nn.Parameter(torch.zeros(e), requires_grad=False)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * inter, cfg.hidden_size), requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(e, cfg.hidden_size, inter), requires_grad=False)
        self.shared = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // tp.size, tp, reduce=False)
            if cfg.n_shared_experts
            else None
        )
        self.tp = tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.router_bias.float() if cfg.scoring_func == "sigmoid" else scores
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            group_scores = (
                grouped.topk(2, dim=-1)[0].sum(dim=-1) if cfg.topk_method == "noaux_tc" else grouped.max(dim=-1).values
            )
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_group, dim=-1)[1], 1.0)
            keep = keep.bool()[:, :, None].expand_as(grouped).reshape(-1, cfg.n_routed_experts)
            choice = choice.masked_fill(~keep, float("-inf") if cfg.topk_method == "noaux_tc" else 0.0)
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weights = self.route(x)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            gate, up = F.linear(x[rows], self.experts_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[e]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        if self.shared is not None:
            out = out + self.shared(x)
        return self.tp.all_reduce(out)


def deepseek_model(cfg: ModelConfig, tp: TPGroup) -> CausalLM:
    def layer(i: int) -> DecoderLayer:
        dense = GatedMLP(cfg.hidden_size, cfg.intermediate_size // tp.size, tp) if not cfg.is_moe_layer(i) else None
        return DecoderLayer(cfg, MLAttention(cfg, tp), dense or MoE(cfg, tp))

    return CausalLM(cfg, layer, cfg.qk_rope_head_dim, tp.size)

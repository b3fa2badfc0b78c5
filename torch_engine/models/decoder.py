"""The decoder skeleton every family shares: embeddings, pre-norm layers, final norm, lm_head,
and the multi-token-prediction module where the checkpoint has one."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torch_engine.attention import AttentionMetadata
from torch_engine.config import ModelConfig
from torch_engine.kv_cache import PagedKVCache
from torch_engine.layer_progress import LayerProgress
from torch_engine.layers import Embedding, Linear, RMSNorm


class DecoderLayer(nn.Module):
    """``h + attn(norm(h))``, bump the layer's progress counter (its KV is written), ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = attn
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, h: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache, layer: int, progress: LayerProgress
    ) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), meta, kv, layer)
        progress.bump(layer)
        return h + self.mlp(self.mlp_norm(h))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: Callable[[int], DecoderLayer], rotary_dim: int, tp_size: int) -> None:
        super().__init__()
        if cfg.num_heads % tp_size:
            raise ValueError(f"{cfg.num_heads} attention heads cannot be split over TP {tp_size}")
        self.cfg = cfg
        self.rotary_dim = rotary_dim
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([layer(i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # DeepSeek-V3's MTP module: one more block, after the last layer (KV layer ``num_layers``)
        self.mtp = MTPModule(cfg, layer(cfg.num_layers)) if cfg.num_mtp_layers else None

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache, progress: LayerProgress
    ) -> torch.Tensor:
        """Hidden states of every row after the last layer (before the final norm)."""
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, meta, kv, i, progress)
        return h


class MTPModule(nn.Module):
    """Multi-token prediction as DeepSeek-V3 defines it (arXiv 2412.19437, section 2.2): from the main
    model's final hidden state at position ``i`` and the embedding of token ``i + 1``, each normed,
    concatenated (embedding first, as the released checkpoints' ``eh_proj`` expects) and projected,
    one transformer block predicts token ``i + 2``. Embedding and output head are the main model's;
    the block's KV lives in KV layer ``num_layers``, paged with the request like every other layer.
    The hidden state fed in is the main model's output after its final norm (as vLLM and SGLang feed it).
    """

    def __init__(self, cfg: ModelConfig, block: DecoderLayer) -> None:
        super().__init__()
        self.layer = cfg.num_layers
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the checkpoint's ``shared_head.norm``

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKVCache,
        progress: LayerProgress,
    ) -> torch.Tensor:
        """``embeds``: embeddings of the next tokens ``[T, H]``; ``hidden``: the main model's normed
        final hidden states at the same positions. Returns the block's output, normed (for lm_head)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.norm(self.block(x, meta, kv, self.layer, progress))

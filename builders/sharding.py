"""HF-named full tensors -> one TP rank's tensors in the engine's names.

Column-parallel (split the output rows): q / k / v, gate / up, MLA q and kv_b, expert gate_up.
Row-parallel (split the input columns): o, down, expert down. Replicated: norms, embeddings,
lm_head, router, MLA kv_a (the latent is the same on every rank), the MTP module's ``eh_proj``.
GQA KV heads are split when TP <= KV heads and replicated (rank r holds head r * kv_heads // TP)
when TP > KV heads. The MTP module's block is sharded like any decoder layer.
"""

from __future__ import annotations

import torch

from builders.checkpoint import Checkpoint
from builders.errors import BuildError
from torch_engine.config import ModelConfig
from torch_engine.quant import Weight, cat_rows, narrow


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if cfg.num_heads % tp:
        raise BuildError(f"TP {tp} does not divide the {cfg.num_heads} attention heads")
    if not cfg.is_mla:
        kv = cfg.num_kv_heads
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            raise BuildError(f"TP {tp} and {kv} KV heads: one must divide the other")
    sizes = {"intermediate_size": cfg.intermediate_size}
    if cfg.n_routed_experts:
        sizes |= {"moe_intermediate_size": cfg.moe_intermediate_size}
    for name, size in sizes.items():
        if size % tp:
            raise BuildError(f"TP {tp} does not divide {name} {size}")


def _rows(w: Weight, part: int, rank: int, dim: int = 0) -> Weight:
    try:
        return narrow(w, dim, part * rank, part)
    except ValueError as exc:  # a packed weight cut inside a block
        raise BuildError(
            f"this TP size cannot split a weight kept as stored: {exc}; build with --weights fp32"
        ) from exc


def _heads(w: Weight, heads: int, per_rank: int, rank_first_head: int) -> Weight:
    """Rows of heads ``[first, first + per_rank)`` of a ``[heads * d, ...]`` projection."""
    d = w.shape[0] // heads
    return narrow(w, 0, rank_first_head * d, per_rank * d)


def _dense(w: Weight) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise BuildError("this tensor cannot be kept as stored (quantized); build with --weights fp32")
    return w


def shard(ck: Checkpoint, tp: int, rank: int) -> dict[str, Weight]:
    cfg = ck.config
    check_tp(cfg, tp)
    g = ck.get
    out: dict[str, Weight] = {
        "embed.weight": g("model.embed_tokens.weight"),
        "norm.weight": g("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = g("lm_head.weight")
    for i in range(cfg.num_layers):
        _layer(out, ck, i, f"model.layers.{i}.", f"layers.{i}.", tp, rank)
    if cfg.num_mtp_layers:  # DeepSeek-V3's MTP module: layer ``num_layers`` in the checkpoint
        src = f"model.layers.{cfg.num_layers}."
        _layer(out, ck, cfg.num_layers, src, "mtp.block.", tp, rank)
        out["mtp.enorm.weight"] = g(src + "enorm.weight")
        out["mtp.hnorm.weight"] = g(src + "hnorm.weight")
        out["mtp.eh_proj.weight"] = g(src + "eh_proj.weight")
        out["mtp.norm.weight"] = g(src + "shared_head.norm.weight")
    return {k: v.contiguous() for k, v in out.items()}


def _layer(out: dict[str, Weight], ck: Checkpoint, i: int, src: str, dst: str, tp: int, rank: int) -> None:
    """One decoder layer (``src``: its HF prefix) -> this rank's tensors under ``dst``."""
    g, cfg = ck.get, ck.config
    hq = cfg.num_heads // tp
    out[dst + "attn_norm.weight"] = g(src + "input_layernorm.weight")
    out[dst + "mlp_norm.weight"] = g(src + "post_attention_layernorm.weight")
    a = src + "self_attn."
    if cfg.is_mla:
        _mla(out, ck, a, dst + "attn.", tp, rank)
    else:
        kv = cfg.num_kv_heads
        kv_per, kv_first = (kv // tp, rank * kv // tp) if tp <= kv else (1, rank * kv // tp)
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            q = _heads(g(f"{a}q_proj.{kind}"), cfg.num_heads, hq, rank * hq)
            k = _heads(g(f"{a}k_proj.{kind}"), kv, kv_per, kv_first)
            v = _heads(g(f"{a}v_proj.{kind}"), kv, kv_per, kv_first)
            out[f"{dst}attn.qkv.{kind}"] = cat_rows([q, k, v])
        if cfg.qk_norm:
            out[dst + "attn.q_norm.weight"] = g(a + "q_norm.weight")
            out[dst + "attn.k_norm.weight"] = g(a + "k_norm.weight")
        out[dst + "attn.o.weight"] = _rows(g(a + "o_proj.weight"), hq * cfg.head_dim, rank, dim=1)
    m = src + "mlp."
    if cfg.is_moe_layer(i):
        _moe(out, ck, m, dst + "mlp.", tp, rank)
    else:
        _mlp(out, ck, m, dst + "mlp.", cfg.intermediate_size // tp, rank)


def _mlp(out: dict[str, Weight], ck: Checkpoint, src: str, dst: str, part: int, rank: int) -> None:
    g = ck.get
    gate = _rows(g(src + "gate_proj.weight"), part, rank)
    up = _rows(g(src + "up_proj.weight"), part, rank)
    out[dst + "gate_up.weight"] = cat_rows([gate, up])
    out[dst + "down.weight"] = _rows(g(src + "down_proj.weight"), part, rank, dim=1)


def _mla(out: dict[str, Weight], ck: Checkpoint, src: str, dst: str, tp: int, rank: int) -> None:
    g, cfg = ck.get, ck.config
    hq = cfg.num_heads // tp
    if cfg.q_lora_rank is None:
        out[dst + "q_proj.weight"] = _heads(g(src + "q_proj.weight"), cfg.num_heads, hq, rank * hq)
    else:
        out[dst + "q_a.weight"] = g(src + "q_a_proj.weight")
        if cfg.attention_bias:
            out[dst + "q_a.bias"] = g(src + "q_a_proj.bias")
        out[dst + "q_a_norm.weight"] = g(src + "q_a_layernorm.weight")
        out[dst + "q_b.weight"] = _heads(g(src + "q_b_proj.weight"), cfg.num_heads, hq, rank * hq)
    out[dst + "kv_a.weight"] = g(src + "kv_a_proj_with_mqa.weight")
    if cfg.attention_bias:
        out[dst + "kv_a.bias"] = g(src + "kv_a_proj_with_mqa.bias")
        out[dst + "o.bias"] = _dense(g(src + "o_proj.bias")) / tp  # each rank adds it, the all-reduce sums
    out[dst + "kv_a_norm.weight"] = g(src + "kv_a_layernorm.weight")
    out[dst + "kv_b.weight"] = _heads(g(src + "kv_b_proj.weight"), cfg.num_heads, hq, rank * hq)
    out[dst + "o.weight"] = _rows(g(src + "o_proj.weight"), hq * cfg.v_head_dim, rank, dim=1)


def _moe(out: dict[str, Weight], ck: Checkpoint, src: str, dst: str, tp: int, rank: int) -> None:
    g, cfg = ck.get, ck.config
    inter = cfg.moe_intermediate_size
    part = inter // tp
    out[dst + "router.weight"] = _dense(g(src + "gate.weight")).float()
    bias_name = src + "gate.e_score_correction_bias"
    out[dst + "router_bias"] = (
        _dense(g(bias_name)).float() if bias_name in ck.tensors else torch.zeros(cfg.n_routed_experts)
    )
    gate_up = _dense(g(src + "experts.gate_up_proj"))  # [E, 2 * inter, hidden]
    lo = part * rank
    out[dst + "experts_gate_up"] = torch.cat(
        [gate_up[:, lo : lo + part], gate_up[:, inter + lo : inter + lo + part]], dim=1
    )
    out[dst + "experts_down"] = _dense(g(src + "experts.down_proj"))[:, :, lo : lo + part].clone()
    if cfg.n_shared_experts:
        _mlp(out, ck, src + "shared_experts.", dst + "shared.", inter * cfg.n_shared_experts // tp, rank)

"""Import a Hugging Face folder (``config.json`` + ``*.safetensors``): Llama, Qwen2, Qwen3, DeepSeek-V2/V3."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from builders.checkpoint import Checkpoint
from builders.errors import BuildError
from builders.mtp_head import with_mtp
from torch_engine.config import Family, ModelConfig, RopeScaling
from torch_engine.quant import Weight

SUPPORTED = {
    "llama": Family.LLAMA,
    "mistral": Family.LLAMA,
    "qwen2": Family.LLAMA,
    "qwen3": Family.LLAMA,
    "deepseek_v2": Family.DEEPSEEK_V2,
    "deepseek_v3": Family.DEEPSEEK_V3,
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)


def _eos_ids(cfg: dict[str, Any], folder: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (
        cfg,
        _read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {},
    ):
        eos = source.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BuildError(f"{path} is unreadable or not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BuildError(f"{path} does not hold a JSON object")
    return data


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(cfg.get("rope_scaling") or params)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    known = set(RopeScaling.model_fields)
    return theta, RopeScaling(rope_type=rope_type, **{k: v for k, v in scaling.items() if k in known and v is not None})


def config_from_hf(cfg: dict[str, Any], folder: Path) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise BuildError(f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(SUPPORTED))}")
    family = SUPPORTED[model_type]
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    common: dict[str, Any] = {
        "family": family,
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": _eos_ids(cfg, folder),
    }
    if model_type == "qwen2":
        common["attention_bias"] = True
    elif model_type == "qwen3":
        common["qk_norm"] = True
        common["attention_bias"] = bool(cfg.get("attention_bias", False))
    elif family is Family.LLAMA:
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise BuildError("Llama checkpoints with attention_bias / mlp_bias are not supported")
    else:
        v3 = family is Family.DEEPSEEK_V3
        common |= {
            "num_kv_heads": heads,
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "q_lora_rank": cfg.get("q_lora_rank"),
            "kv_lora_rank": cfg["kv_lora_rank"],
            "qk_nope_head_dim": cfg["qk_nope_head_dim"],
            "qk_rope_head_dim": cfg["qk_rope_head_dim"],
            "v_head_dim": cfg["v_head_dim"],
            "head_dim": cfg["qk_rope_head_dim"],
            "rope_interleave": bool(cfg.get("rope_interleave", True)) if v3 else True,
            "n_routed_experts": cfg.get("n_routed_experts") or 0,
            "n_shared_experts": cfg.get("n_shared_experts") or 0,
            "num_experts_per_tok": cfg.get("num_experts_per_tok") or 0,
            "moe_intermediate_size": cfg.get("moe_intermediate_size") or 0,
            "first_k_dense_replace": cfg.get("first_k_dense_replace") or 0,
            "moe_layer_freq": cfg.get("moe_layer_freq") or 1,
            "routed_scaling_factor": cfg.get("routed_scaling_factor") or 1.0,
            "scoring_func": "sigmoid" if v3 else cfg.get("scoring_func", "softmax"),
            "topk_method": "noaux_tc" if v3 else cfg.get("topk_method") or "greedy",
            "n_group": cfg.get("n_group") or 1,
            "topk_group": cfg.get("topk_group") or 1,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) if v3 else False,
        }
    try:
        return ModelConfig(**common)
    except ValidationError as exc:
        raise BuildError(f"config.json describes a model this engine cannot run: {exc}") from exc


def _fuse_experts(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Per-expert ``experts.{j}.{gate,up,down}_proj`` -> fused ``experts.gate_up_proj`` / ``experts.down_proj``."""
    for layer in range(cfg.num_kv_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        if not cfg.is_moe_layer(layer) or f"{prefix}gate_up_proj" in tensors:
            continue
        gate_up, down = [], []
        for j in range(cfg.n_routed_experts):
            e = f"{prefix}{j}."
            try:
                gate_up.append(torch.cat([tensors.pop(e + "gate_proj.weight"), tensors.pop(e + "up_proj.weight")]))
                down.append(tensors.pop(e + "down_proj.weight"))
            except KeyError as exc:
                raise BuildError(f"checkpoint lacks expert tensor {exc.args[0]}") from None
        tensors[prefix + "gate_up_proj"] = torch.stack(gate_up)
        tensors[prefix + "down_proj"] = torch.stack(down)


def load_hf_folder(folder: Path) -> Checkpoint:
    if not (folder / "config.json").is_file():
        raise BuildError(f"{folder} is not a Hugging Face checkpoint folder: config.json is missing")
    raw = _read_json(folder / "config.json")
    cfg = config_from_hf(raw, folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BuildError(f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors |= load_file(str(f))
        except (SafetensorError, OSError) as exc:
            raise BuildError(f"{f} is corrupt or unreadable: {exc}") from exc
    cfg = with_mtp(cfg, int(raw.get("num_nextn_predict_layers") or 0), tensors)
    if cfg.n_routed_experts:
        _fuse_experts(tensors, cfg)
    if "lm_head.weight" not in tensors and not cfg.tie_word_embeddings:
        cfg = cfg.model_copy(update={"tie_word_embeddings": True})

    def save_tokenizer(out: Path) -> bool:
        found = [n for n in TOKENIZER_FILES if (folder / n).is_file()]
        for n in found:
            shutil.copy2(folder / n, out / n)
        return "tokenizer.json" in found or "tokenizer.model" in found

    return Checkpoint(cfg, dict[str, Weight](tensors), save_tokenizer, folder.name)

"""DeepSeek-V3's multi-token-prediction (MTP) layer in a checkpoint: found, checked, or attached.

In DeepSeek-V3's checkpoints the MTP module is layer ``num_hidden_layers`` (``model.layers.61.``):
a standard decoder layer's tensors plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``,
with copies of the embedding (``embed_tokens``) and the output head (``shared_head.head``), which
the engine shares with the model. A head trained elsewhere (``builders/train_mtp.py``) is a
safetensors file with the same names, attached at build time (``BuildOptions.mtp_head``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from builders.checkpoint import Checkpoint
from builders.errors import BuildError
from torch_engine.config import ModelConfig

MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_SHARED = (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", "lm_head.weight"))


def with_mtp(cfg: ModelConfig, declared: int, tensors: dict[str, torch.Tensor]) -> ModelConfig:
    """``cfg`` with its MTP layer when ``declared`` (``num_nextn_predict_layers``) and its tensors
    are there; without it when they are not (Hugging Face's own save drops them); a partial or
    inconsistent one is an error. Only the first MTP layer is used."""
    prefix = f"model.layers.{cfg.num_layers}."
    if not declared or not any(k.startswith(prefix) for k in tensors):
        return cfg
    missing = [prefix + k for k in MTP_TENSORS if prefix + k not in tensors]
    if missing:
        raise BuildError(f"the checkpoint's MTP layer {cfg.num_layers} is incomplete: it lacks {missing}")
    for own, main in MTP_SHARED:
        mine, theirs = tensors.get(prefix + own), tensors.get(main, tensors.get("model.embed_tokens.weight"))
        if mine is not None and theirs is not None and not torch.equal(mine, theirs):
            raise BuildError(f"the MTP layer's {prefix + own} differs from {main}: MTP shares the model's")
    return cfg.model_copy(update={"num_mtp_layers": 1})


def attach_head(ck: Checkpoint, path: Path) -> Checkpoint:
    """``ck`` with the MTP head in ``path`` (tensors named ``model.layers.{num_layers}.*``)."""
    if ck.config.num_mtp_layers:
        raise BuildError(f"checkpoint {ck.name!r} already has an MTP layer; it cannot take another")
    try:
        head = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise BuildError(f"MTP head {path} is unreadable: {exc}") from exc
    prefix = f"model.layers.{ck.config.num_layers}."
    foreign = sorted(k for k in head if not k.startswith(prefix))
    if foreign:
        raise BuildError(f"MTP head {path} is not for this model (layer {ck.config.num_layers}): it has {foreign[:3]}")
    cfg = with_mtp(ck.config, 1, head)
    if not cfg.num_mtp_layers:
        raise BuildError(f"MTP head {path} holds no tensors")
    return Checkpoint(cfg, {**ck.tensors, **head}, ck.save_tokenizer, f"{ck.name}+mtp", ck.converted)

"""Quantize a checkpoint's dense GEMM weights at build time (``disagg build --weights q8_0 | q5_1 | q5_0 | q4_1 |
q4_0``).

A Hugging Face checkpoint, or the dense tensors of a GGUF file (F16, BF16, F32; its quantized ones
are kept or converted on import, ``builders/gguf_convert.py``), become the block formats the engine's integer
kernels read (``torch_engine/quant.py``), quantized by gguf's reference quantizer — the file a
``llama-quantize`` run would write for those tensors:

- the decoder layers' attention projections (q, k, v, o) and dense MLP (gate, up, down): the chosen
  format (Q8_0: int8 per block of 32 with an fp16 scale; Q5_0: 5 bits with a scale; Q5_1: 5 bits with a
  scale and a minimum; Q4_0: int4 with a scale; Q4_1: int4 with a scale and a minimum);
- the token embedding and an untied lm_head: Q8_0 whatever the choice (as llama.cpp's Q4 presets
  keep the output in 6-8 bits: the logits are the most sensitive GEMM);
- everything else (norms, biases, MLA and MoE weights, rows whose width is not a multiple of 32)
  stays dense.

The error is measured and returned (``QuantReport``): the relative RMS error of each format over
the weights it replaced; ``build_engine`` logs it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from builders.checkpoint import Checkpoint
from torch_engine.quant import BLOCK, Packed, QuantKind, from_gguf_blocks

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(slots=True)
class QuantReport:
    """Per format: tensors quantized, weights, and the squared error and squared norm summed over them."""

    tensors: dict[str, int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    err2: dict[str, float] = field(default_factory=dict)
    norm2: dict[str, float] = field(default_factory=dict)

    def add(self, key: QuantKind | str, dense: torch.Tensor, packed: Packed) -> None:
        """One tensor ``dense`` replaced by ``packed``, under ``key`` (a format, or a conversion's name)."""
        k = key.name if isinstance(key, QuantKind) else key
        diff = packed.dequantize().double() - dense.double()
        self.tensors[k] = self.tensors.get(k, 0) + 1
        self.weights[k] = self.weights.get(k, 0) + dense.numel()
        self.err2[k] = self.err2.get(k, 0.0) + float((diff * diff).sum())
        self.norm2[k] = self.norm2.get(k, 0.0) + float((dense.double() ** 2).sum())

    def relative_rms(self, key: QuantKind | str) -> float:
        """sqrt(sum of squared errors / sum of squared weights) over the tensors of ``key``."""
        k = key.name if isinstance(key, QuantKind) else key
        n = self.norm2.get(k, 0.0)
        return float(np.sqrt(self.err2.get(k, 0.0) / n)) if n else 0.0

    def errors(self) -> dict[str, float]:
        """Each key's relative RMS error (the engine manifest's ``converted``)."""
        return {k: self.relative_rms(k) for k in sorted(self.tensors)}

    def summary(self) -> str:
        return "; ".join(
            f"{k}: {self.tensors[k]} tensors, {self.weights[k]:,} weights, relative RMS error "
            f"{100 * self.relative_rms(k):.3g}%"
            for k in sorted(self.tensors)
        )


def quantize_tensor(w: torch.Tensor, kind: QuantKind) -> Packed:
    """A dense ``[N, K]`` weight (K a multiple of 32) in ``kind``, by gguf's reference quantizer."""
    n, k = w.shape
    raw = quantize(w.detach().float().numpy(), GGMLQuantizationType(int(kind)))
    return from_gguf_blocks(kind, np.asarray(raw), (n, k))


def _target(name: str, ck: Checkpoint, kind: QuantKind) -> QuantKind | None:
    """The format ``name`` is quantized to, or None (it stays as it is)."""
    if name in _TABLES:
        return QuantKind.Q8_0
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    layer, part = int(m.group(1)), m.group(2)
    if part.startswith("self_attn") and ck.config.is_mla:
        return None
    if part.startswith("mlp") and ck.config.is_moe_layer(layer):
        return None
    return kind


def quantize_checkpoint(ck: Checkpoint, kind: QuantKind) -> tuple[Checkpoint, QuantReport]:
    """``ck`` with its dense GEMM weights in ``kind`` (tables in Q8_0); tensors already packed stay."""
    report = QuantReport()
    tensors = dict(ck.tensors)
    for name, w in ck.tensors.items():
        target = _target(name, ck, kind)
        if target is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] % BLOCK:
            continue
        packed = quantize_tensor(w, target)
        report.add(target, w, packed)
        tensors[name] = packed
    log.info("quantized %s at build time: %s", ck.name, report.summary())
    errors = {**ck.converted, **{f"dense->{k}": e for k, e in report.errors().items()}}
    return Checkpoint(ck.config, tensors, ck.save_tokenizer, ck.name, errors), report

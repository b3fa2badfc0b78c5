"""Loading an engine directory: the compute dtype, this rank's weights, the CPU fast path, and the
short description of the result (``EngineDescription``) that benchmarks and reports read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from torch_engine.config import EngineConfig, EngineManifest, ModelConfig
from torch_engine.cpu import cpu_info
from torch_engine.kernels import cpu_kernels
from torch_engine.layers import Embedding, GatedMLP, Linear, RMSNorm
from torch_engine.models import build_model
from torch_engine.models.decoder import CausalLM
from torch_engine.parallel import TPGroup
from torch_engine.quant import PACKED_KEY, Packed, QuantKind, group


@dataclass(frozen=True, slots=True)
class EngineDescription:
    """What an engine is, for benchmarks and reports (``LLMEngine.describe``)."""

    source: str  # the checkpoint the engine directory was built from
    model: ModelConfig
    tp_size: int
    device: str
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pages' (models.run_kv_dtype: the config's, else the compute dtype or auto's bf16)
    page_size: int
    num_pages: int
    max_model_len: int
    kernel_path: str  # device / dtype / weight preparation / attention kernel / SIMD
    weight_bytes: int  # this rank's parameters (tied embeddings once)
    kv_bytes_per_token: int  # every layer's KV of one token on this rank
    cache_identity: str = ""  # the root of the prefix cache's page keys (model fingerprint, dtype, layout)


def run_dtype(config: EngineConfig, manifest: EngineManifest, device: torch.device) -> torch.dtype:
    """The dtype the engine computes in: the config's, or ``auto``: bf16 on GPUs and on CPUs with native
    bf16 dot products (AVX-512 BF16 / AMX), fp32 elsewhere; None: the manifest's."""
    if config.dtype == "auto":
        native = device.type == "cuda" or cpu_info().native_bf16
        return torch.bfloat16 if native else torch.float32
    return (config.dtype or manifest.dtype).torch


def _read(path: Path, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Packed]]:
    """A rank's file: its dense tensors and its packed weights (``torch_engine/quant.py``)."""
    try:
        state = load_file(str(path), device=str(device))
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        kinds = {name: QuantKind[kind] for name, kind in json.loads(meta.get(PACKED_KEY, "{}")).items()}
        packed = {name: Packed.from_tensors(kind, name, state) for name, kind in kinds.items()}
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path} is corrupt or unreadable: {exc}") from exc
    return state, packed


def load_weights(
    manifest: EngineManifest,
    config: EngineConfig,
    tp: TPGroup,
    device: torch.device,
    dtype: torch.dtype,
    keep_packed: bool = False,
) -> CausalLM:
    """This rank's model. Packed weights stay packed where ``keep_packed`` (the fast CPU path with its
    kernels), else they are dequantised to ``dtype`` here."""
    path = config.engine_dir / f"rank{tp.rank}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{config.engine_dir} has no weights for TP rank {tp.rank} ({path.name})")
    state, packed = _read(path, device)
    kernels = cpu_kernels() if keep_packed and packed else None
    if kernels is None:
        state |= {name: p.dequantize(dtype) for name, p in packed.items()}
        packed = {}
    with torch.device("meta"):
        model = build_model(manifest.model, tp)
    expected = set(model.state_dict())
    if manifest.model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    present = set(state) | set(packed)
    missing, unexpected = expected - present, present - expected
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    keep_fp32 = ("router.weight", "router_bias")
    state = {k: v if k.endswith(keep_fp32) else v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if kernels is not None:
        _attach(model, packed, dtype, kernels, path)
    elif manifest.model.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def _attach(model: CausalLM, packed: dict[str, Packed], dtype: torch.dtype, kernels: ModuleType, path: Path) -> None:
    """The packed weights, grouped for the integer kernels, into their modules (tied: lm_head computes
    with the embedding's table)."""
    for name, p in packed.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        if not isinstance(module, Linear | Embedding):
            raise ValueError(f"{path}: {name} is packed, but {type(module).__name__} cannot compute with it")
        module.set_quant(group(p, kernels), dtype, kernels)
    if model.cfg.tie_word_embeddings:
        if model.embed.quant is not None:
            model.lm_head.set_quant(model.embed.quant, dtype, kernels)
        else:
            model.lm_head.weight = model.embed.weight
    # the logits are the most sensitive GEMM: SmolLM2's perplexity lost 0.16 % of its 0.19 % there (2k tokens)
    model.lm_head.precise = True


def prepare_cpu_path(model: CausalLM, device: torch.device, dtype: torch.dtype) -> bool:
    """The fast CPU path (CPU, fp32 / bf16): every GEMM weight prepared once (oneDNN packing, and the
    small-batch bf16 kernel's copy where the CPU has it), RMSNorm on the compiled kernel. True if
    any weight was packed."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    kernels = cpu_kernels()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for m in linears:
        m.prepare(kernels)
    for module in model.modules():
        if isinstance(module, RMSNorm | GatedMLP):
            module.kernels = kernels
    return any(m.packed is not None for m in linears)


def kernel_path(
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    prepacked: bool,
    fused_attention: bool,
    graphs: bool,
    fused_step: bool = False,
) -> str:
    """Which compute path an engine runs: device, dtype, weight preparation, decode graphs / attention
    (+ the compiled decode step)."""
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return f"cuda/{name}/{'cuda-graphs' if graphs else 'eager'}"
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    small = any(m.vnni is not None for m in linears)
    gemm = ("gemm-bf16+onednn-packed" if small else "onednn-packed") if prepacked else "plain"
    kinds = sorted({m.quant.kind.name.lower() for m in linears if m.quant is not None})
    if kinds and (kernels := cpu_kernels()) is not None:  # the dense rest (an MTP head's) after a "+"
        rest = f"+{gemm}" if any(m.quant is None for m in linears) else ""
        gemm = f"{'+'.join(kinds)}-int8-{kernels.i8_path()}{rest}"
    attention = ("fused-attention" if fused_attention else "torch-attention") + ("+fused-step" if fused_step else "")
    return f"cpu/{name}/{gemm}/{attention}/{cpu_info().simd}"


def weight_bytes(model: CausalLM) -> int:
    """Bytes of this rank's parameters, each storage once (tied embeddings are one tensor)."""
    seen: set[int] = set()
    total = 0
    quant = [t for m in model.modules() if isinstance(m, Linear | Embedding) and m.quant for t in m.quant.parts()]
    for p in [*model.parameters(), *quant]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total

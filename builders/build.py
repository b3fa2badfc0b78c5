"""``build_engine``: checkpoint -> engine directory for one role and TP size.

An engine directory holds ``engine.json`` (the manifest: architecture, dtype, page size, KV
layout, TP size, role, source fingerprint), ``rank{r}.safetensors`` per TP rank, and the
tokenizer files. Builds are cached: a directory whose manifest carries the same fingerprint
(source files' names, sizes and mtimes + build options + builder version) is reused.
Directories are written to a temporary sibling and renamed into place, so a crashed build
never leaves a half-written engine behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from builders.checkpoint import Checkpoint
from builders.embedded import resolve_source
from builders.errors import BuildError
from builders.gguf_convert import same_format_for_fused
from builders.gguf_import import load_gguf
from builders.hf_import import load_hf_folder
from builders.mtp_head import attach_head
from builders.quantize import quantize_checkpoint
from builders.sharding import check_tp, shard
from torch_engine.config import MANIFEST_NAME, DType, EngineManifest, KVLayout, Role, WeightStorage
from torch_engine.quant import PACKED_KEY, Packed, QuantKind, Weight

BUILDER_VERSION = 8  # 2: a GGUF's K-quants converted, not dequantised; 3-6: Q5_0, Q5_1, Q6_K, Q4_K / Q5_K kept;
# 7: Q3_K -> Q6_K, IQ4_NL kept, IQ4_XS -> IQ4_NL; 8: Q3_K kept

__all__ = ["BuildError", "BuildOptions", "build_engine", "default_engine_dir", "load_checkpoint"]


@dataclass(frozen=True, slots=True)
class BuildOptions:
    role: Role = Role.COLOCATED
    tp_size: int = 1
    dtype: DType = DType.BFLOAT16
    page_size: int = 16
    kv_layout: KVLayout = KVLayout.HND
    mtp_head: Path | None = None  # a trained MTP head to attach (``builders/train_mtp.py``)
    weights: WeightStorage = WeightStorage.AS_STORED  # a GGUF's quantized tensors kept packed
    quantize: QuantKind | None = None  # dense GEMM weights quantized to this block format (builders/quantize.py)


def load_checkpoint(source: str, weights: WeightStorage = WeightStorage.DENSE) -> Checkpoint:
    path = resolve_source(source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise BuildError(f"{path}: a checkpoint file must be .gguf (or pass a Hugging Face folder)")
        return load_gguf(path, packed=weights is WeightStorage.AS_STORED)
    return load_hf_folder(path)


def _fingerprint(path: Path, opts: BuildOptions) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for f in files:
        st = f.stat()
        # whole seconds: archives (tar layers of an image, zip) keep mtimes to the second, not the nanosecond
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)};".encode())
    fields: list[object] = [BUILDER_VERSION, opts.role.value, opts.tp_size, opts.dtype.value, opts.page_size]
    fields += [opts.kv_layout.value] + ([opts.weights.value] if opts.weights is WeightStorage.AS_STORED else [])
    fields += [f"quantize:{opts.quantize.name}"] if opts.quantize is not None else []
    opts_text = json.dumps(fields)
    h.update(opts_text.encode())
    if opts.mtp_head is not None:
        st = Path(opts.mtp_head).stat()
        h.update(f"mtp:{Path(opts.mtp_head).resolve()}:{st.st_size}:{int(st.st_mtime)};".encode())
    return h.hexdigest()


DEFAULT_ENGINE_CACHE = Path.home() / ".cache" / "disagg" / "engines"  # built engines, keyed by fingerprint


def default_engine_dir(cache_root: Path, source: str, opts: BuildOptions) -> Path:
    path = resolve_source(source)
    name = path.stem if path.is_file() else path.name
    fp = _fingerprint(path, opts)[:12]
    mtp = "-mtp" if opts.mtp_head is not None else ""
    packed = "-as-stored" if opts.weights is WeightStorage.AS_STORED and path.suffix == ".gguf" else ""
    packed += f"-{opts.quantize.name.lower()}" if opts.quantize is not None else ""
    return cache_root / f"{name}{mtp}-{opts.role.value}-tp{opts.tp_size}-{opts.dtype.value}{packed}-{fp}"


def _cached(out: Path, fingerprint: str, tp: int) -> bool:
    if not (out / MANIFEST_NAME).is_file():
        return False
    try:
        manifest = EngineManifest.load(out)
    except ValueError:
        return False
    return manifest.fingerprint == fingerprint and all((out / f"rank{r}.safetensors").is_file() for r in range(tp))


def _flat(weights: dict[str, Weight], dtype: DType) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One rank's weights as safetensors entries (dense ones in ``dtype``, routers in fp32; packed ones
    as their parts) and the packed ones' kinds."""
    tensors: dict[str, torch.Tensor] = {}
    packed: dict[str, str] = {}
    for k, v in weights.items():
        if isinstance(v, Packed):
            tensors |= {n: t.contiguous() for n, t in v.tensors(k).items()}
            packed[k] = v.kind.name
        else:
            tensors[k] = v if k.endswith(("router.weight", "router_bias")) else v.to(dtype.torch)
    return tensors, packed


def build_engine(source: str, out: Path, opts: BuildOptions = BuildOptions(), progress: bool = True) -> Path:
    """Build (or reuse) the engine for ``source`` in ``out``; returns ``out``."""
    if opts.tp_size < 1:
        raise BuildError(f"tp_size must be >= 1, got {opts.tp_size}")
    if opts.page_size < 1:
        raise BuildError(f"page_size must be >= 1, got {opts.page_size}")
    path = resolve_source(source)
    fingerprint = _fingerprint(path, opts)
    out = Path(out)
    if _cached(out, fingerprint, opts.tp_size):
        return out
    ck = load_checkpoint(source, opts.weights)
    if opts.mtp_head is not None:
        ck = attach_head(ck, Path(opts.mtp_head))
    if opts.quantize is not None:
        ck, _ = quantize_checkpoint(ck, opts.quantize)
    ck = same_format_for_fused(ck)
    check_tp(ck.config, opts.tp_size)
    packed_any = any(isinstance(w, Packed) for w in ck.tensors.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        ranks = range(opts.tp_size)
        for r in tqdm(ranks, desc=f"building {ck.name} tp{opts.tp_size}", unit="rank", disable=not progress):
            tensors, packed = _flat(shard(ck, opts.tp_size, r), opts.dtype)
            save_file(tensors, str(tmp / f"rank{r}.safetensors"), metadata={PACKED_KEY: json.dumps(packed)})
        has_tok = ck.save_tokenizer(tmp)
        EngineManifest(
            model=ck.config,
            role=opts.role,
            tp_size=opts.tp_size,
            dtype=opts.dtype,
            page_size=opts.page_size,
            kv_layout=opts.kv_layout,
            source=str(path),
            fingerprint=fingerprint,
            has_tokenizer=has_tok,
            weights=WeightStorage.AS_STORED if packed_any else WeightStorage.DENSE,
            conversion_error=ck.converted,
        ).save(tmp)
        if out.exists():
            shutil.rmtree(out)
        for f in tmp.iterdir():  # readable by every user of a shared cache (an image's): mkdtemp and
            f.chmod(0o644)  # safetensors create their directory and weight files private (0700 / 0600)
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

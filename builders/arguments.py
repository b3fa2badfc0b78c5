"""The arguments every command that needs an engine shares (``engine_source_arguments``), and how
they become an engine directory (``engine_dir_of``: ``--engine`` as given, else built from
``--model`` and cached by fingerprint)."""

from __future__ import annotations

import argparse
from pathlib import Path

from builders import BuildOptions, build_engine
from builders.build import DEFAULT_ENGINE_CACHE, default_engine_dir
from torch_engine.config import DType, KVLayout, Role, WeightStorage
from torch_engine.quant import QuantKind


def engine_source_arguments(p: argparse.ArgumentParser, dtype: DType = DType.BFLOAT16) -> None:
    p.add_argument("--model", default="smollm2", help="checkpoint: 'smollm2' (embedded), a .gguf file or an HF folder")
    p.add_argument("--engine", type=Path, default=None, help="use this engine directory instead of building one")
    p.add_argument("--dtype", choices=[d.value for d in DType], default=dtype.value)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layout", choices=[k.value for k in KVLayout], default=KVLayout.HND.value)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_ENGINE_CACHE, help="where built engines are cached")
    p.add_argument("--mtp-head", type=Path, default=None, help="attach this trained MTP head (disagg train-mtp)")
    p.add_argument(
        "--weights",
        choices=[*WEIGHTS, *QUANTIZE],
        default="as-stored",
        help="as-stored: a GGUF's Q8_0 / Q6_K / Q5_K / Q5_1 / Q5_0 / Q4_K / Q4_1 / Q4_0 / IQ4_NL / Q3_K / Q2_K tensors "
        "stay quantized and the engine computes with them, its other quantized tensors are converted (IQ4_XS to "
        "IQ4_NL with fp16-rounded scales, the other IQ formats requantized to Q8_0; the "
        "error is logged and kept in engine.json); bf16 / fp32: every weight dequantised to that dtype (sets "
        "--dtype); q8_0 / q6_k / ... / q4_0 / iq4_nl / q3_k / q2_k: as-stored, and the dense GEMM weights left "
        "(a Hugging Face checkpoint's, a GGUF's F16) quantized to that format at build time (embedding and lm_head "
        "Q8_0; the K-quants' rows not a multiple of 256 weights Q8_0; the error is logged)",
    )


WEIGHTS = {"as-stored": None, "bf16": DType.BFLOAT16, "fp32": DType.FLOAT32}  # --weights -> dense dtype
QUANTIZE = {k.name.lower(): k for k in QuantKind}  # --weights q4_0 ... q8_0 -> build-time format


def build_options(a: argparse.Namespace, role: Role = Role.COLOCATED) -> BuildOptions:
    dense = WEIGHTS.get(a.weights)
    return BuildOptions(
        role=role,
        tp_size=a.tp,
        dtype=dense or DType(a.dtype),
        weights=WeightStorage.AS_STORED if dense is None else WeightStorage.DENSE,
        page_size=a.page_size,
        kv_layout=KVLayout(a.layout),
        mtp_head=a.mtp_head,
        quantize=QUANTIZE.get(a.weights),
    )


def engine_dir_of(a: argparse.Namespace, role: Role = Role.COLOCATED) -> Path:
    if a.engine is not None:
        return Path(a.engine)
    opts = build_options(a, role)
    return build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts)

"""Q3_K and Q2_K kept as stored vs what the builder made of them before (Q3_K: Q6_K, exactly, the quants + 28 with the
same scales; Q2_K: Q8_0, gguf's quantizer over its dequantised weights), on llama.cpp's own Q3_K_S and Q2_K mixes of
SmolLM2, and on the embedded file with its FFN-down rewritten as Q2_K (``Q2_K_DOWN``: our round-to-nearest encoder,
``builders.quantize.quantize_q2_k``; llama.cpp's own Q2_K mix of SmolLM2 has no Q2_K tensor: its FFN-down is Q3_K there,
the file identical to its Q3_K_S).

Only SmolLM2's FFN-down (1536 columns) is a multiple of 256 weights a row, so only it can be a K-quant; the rest of
those files is llama.cpp's fallback for 576-column rows (its Q3_K_M mix has no Q3_K tensor at all here). Two engines
per file in one process: one built from the file, one from a copy whose Q3_K / Q2_K tensors were rewritten as the old
builder made them. Each point alternates the two, 5 pairs (``bench.ab.alternate``): medians, and the median of the
pairs' ratios.

Needs llama.cpp's binding (``make bench-peers``) to write the files.
Run from the repository root: ``.venv/bin/python benchmarks/q3_k-2026-12-04/run.py OUT.json
[--files Q3_K_S Q2_K_DOWN]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize, quantize

from bench.ab import main_files
from bench.gguf_rewrite import rewrite
from builders.embedded import smollm2_gguf
from builders.gguf_convert import _as
from builders.quantize import q6_k_blocks, quantize_blocks
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.quant import QuantKind

ROOT = Path("/tmp/q3k")
T = GGMLQuantizationType


def as_before(src: Path, dst: Path) -> int:
    """``src`` with every Q3_K tensor as the Q6_K blocks of the same values and every Q2_K one as the Q8_0 gguf's
    quantizer makes of its dequantised weights (what the old builder made of them)."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if t.tensor_type not in (T.Q2_K, T.Q3_K):
            return None
        n, k = int(t.shape[1]), int(t.shape[0])
        if t.tensor_type is T.Q2_K:
            return np.asarray(quantize(np.asarray(dequantize(t.data, T.Q2_K)).reshape(n, k), T.Q8_0)), T.Q8_0
        q6 = _as(from_gguf_blocks(QuantKind.Q3_K, t.data, (n, k)), QuantKind.Q6_K)
        assert q6.m is not None
        return q6_k_blocks(q6.d.numpy(), q6.m.numpy(), q6.quants().numpy().reshape(n, k)), T.Q6_K

    return rewrite(src, dst, convert)


def q2_k_down(dst: Path) -> None:
    """The embedded file with every FFN-down weight (1536 columns) as Q2_K, the rest as it is."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if not t.name.endswith("ffn_down.weight"):
            return None
        dense = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(int(t.shape[1]), -1)
        return quantize_blocks(dense, QuantKind.Q2_K), T.Q2_K

    rewrite(smollm2_gguf(), dst, convert)


if __name__ == "__main__":
    if not (ROOT / "smollm2-q2_k_down.gguf").exists():
        ROOT.mkdir(parents=True, exist_ok=True)
        q2_k_down(ROOT / "smollm2-q2_k_down.gguf")
    main_files(ROOT, as_before, ["Q3_K_S", "Q2_K_DOWN"])

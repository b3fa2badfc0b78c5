"""Q3_K kept as stored vs the Q6_K the builder made of it before (exactly: the quants + 28, the same scales), on
llama.cpp's own Q3_K_S and Q3_K_M of SmolLM2.

Only SmolLM2's FFN-down (1536 columns) is a multiple of 256 weights a row, so only it can be Q3_K; the rest of those
files is llama.cpp's fallback for 576-column rows. Two engines per file in one process: one built from the file, one
from a copy whose Q3_K tensors were rewritten as the Q6_K blocks of the same values. Each point alternates the two,
5 pairs (``bench.ab.alternate``): medians, and the median of the pairs' ratios.

Needs llama.cpp's binding (``make bench-peers``) to write the files.
Run from the repository root: ``.venv/bin/python benchmarks/q3_k-2026-12-04/run.py OUT.json [--files Q3_K_S Q3_K_M]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

from bench.ab import main_files
from bench.gguf_rewrite import rewrite
from builders.gguf_convert import _as
from builders.quantize import q6_k_blocks
from torch_engine.quant import QuantKind, from_gguf_blocks

ROOT = Path("/tmp/q3k")
T = GGMLQuantizationType


def as_before(src: Path, dst: Path) -> int:
    """``src`` with every Q3_K tensor as the Q6_K blocks of the same values (what the old builder made of it)."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if t.tensor_type is not T.Q3_K:
            return None
        n, k = int(t.shape[1]), int(t.shape[0])
        q6 = _as(from_gguf_blocks(QuantKind.Q3_K, t.data, (n, k)), QuantKind.Q6_K)
        assert q6.m is not None
        return q6_k_blocks(q6.d.numpy(), q6.m.numpy(), q6.quants().numpy().reshape(n, k)), T.Q6_K

    return rewrite(src, dst, convert)


if __name__ == "__main__":
    main_files(ROOT, as_before, ["Q3_K_S", "Q3_K_M"])

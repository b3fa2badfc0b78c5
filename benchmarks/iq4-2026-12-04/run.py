"""IQ4_NL kept as stored (IQ4_XS brought to it) and Q3_K as Q6_K vs what the builder made of them before (Q8_0,
requantized by gguf's quantizer), on llama.cpp's own IQ4_XS and Q3_K_S of SmolLM2.

SmolLM2's IQ4_XS file holds 180 IQ4_NL tensors (the 576-column ones, llama.cpp's fallback), 27 IQ4_XS and 3 Q5_K
(FFN-down); its Q3_K_S file 30 Q3_K (FFN-down) and 180 Q4_0. Two engines per file in one process: one built from the
file, one from a copy whose IQ4 / Q3_K tensors were rewritten as the Q8_0 the old builder made of them. Each point
alternates the two, 5 pairs (``bench.ab.alternate``): medians, and the median of the pairs' ratios.

Needs llama.cpp's binding (``make bench-peers``) to write the files.
Run from the repository root: ``.venv/bin/python benchmarks/iq4-2026-12-04/run.py OUT.json [--files IQ4_XS Q3_K_S]``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize, quantize

from bench.ab import main_files
from bench.gguf_rewrite import rewrite

ROOT = Path("/tmp/iq4")
T = GGMLQuantizationType
CHANGED = (T.IQ4_NL, T.IQ4_XS, T.Q3_K)  # the formats this change builds differently


def as_before(src: Path, dst: Path) -> int:
    """``src`` with every IQ4_NL / IQ4_XS / Q3_K tensor as the Q8_0 the old builder made of it."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if t.tensor_type not in CHANGED:
            return None
        dense = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(int(t.shape[1]), -1)
        return np.asarray(quantize(dense, T.Q8_0)), T.Q8_0

    return rewrite(src, dst, convert)


if __name__ == "__main__":
    main_files(ROOT, as_before, ["IQ4_XS", "Q3_K_S"])

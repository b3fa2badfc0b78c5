"""The K-quants kept as stored vs the forms the builder gave them before (``before.py``), on llama.cpp's own
Q4_K_M and Q5_K_M of SmolLM2.

In SmolLM2's files the 1536-column FFN-down weights are the K-quants (Q4_K_M: Q4_K / Q6_K; Q5_K_M: Q5_K / Q6_K);
the 576-column tensors are llama.cpp's fallbacks (Q5_0 / Q5_1 / Q8_0), as stored in both engines. Two engines per
file in one process: one built from the file (K-quants kept), one from a copy whose K-quant tensors were rewritten
as what the old builder made of them. Each point alternates the two, 5 pairs (``bench.ab.alternate``): medians,
and the median of the pairs' ratios.

Needs llama.cpp's binding (``make bench-peers``) to write the files.
Run from the repository root: ``.venv/bin/python benchmarks/k-quants-2026-12-04/run.py OUT.json [--files Q4_K_M
Q5_K_M] [--march x86-64-v3]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

import torch_engine.kernels as tk
from bench.ab import compare_files
from bench.gguf_rewrite import rewrite
from torch_engine.cpu import cpu_info
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.quant import QuantKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from before import KEPT, before, gguf_blocks

ROOT = Path("/tmp/kquants")


def as_before(src: Path, dst: Path) -> int:
    """``src`` with every K-quant tensor rewritten as what the old builder made of it."""

    def convert(t: ReaderTensor) -> tuple[object, GGMLQuantizationType] | None:
        if int(t.tensor_type) not in {int(k) for k in KEPT}:
            return None
        p = from_gguf_blocks(QuantKind(int(t.tensor_type)), t.data, (int(t.shape[1]), int(t.shape[0])))
        return gguf_blocks(before(p))

    return rewrite(src, dst, convert)  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--march", default=None, help="build the kernels for this -march (x86-64-v3: the AVX2 paths)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--files", nargs="+", default=["Q4_K_M", "Q5_K_M"])
    p.add_argument("out", type=Path)
    a = p.parse_args()
    if a.march:
        tk.use_march(a.march)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result: dict[str, object] = {"cpu": cpu_info().as_dict(), "march": a.march or "native", "when": when}
    for ftype in a.files:
        result[ftype] = compare_files(ROOT, ftype, as_before, a.threads, a.batches)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

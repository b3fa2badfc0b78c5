"""Eager vs compiled decode step on SmolLM2 built dense fp32 (the engine an HF checkpoint gets in fp32: an
AVX2 CPU's ``auto``, or ``dtype: float32`` anywhere), side by side: the same engine with ``fused_decode`` off
and on, alternated (which goes first alternates too), medians of 5 and the median of the 5 pairs' ratios
(this machine's speed drifts by tens of percent within minutes); prompt 256, 32 decode steps.
``--march x86-64-v3`` runs the kernels built for an AVX2-only CPU (on this CPU: the AVX2 code paths, not an
AVX2 CPU's speed).

Run from the repository root:
``.venv/bin/python benchmarks/fused-dense-fp32-2026-12-03/run.py OUT.json [--march x86-64-v3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import torch_engine.kernels as tk
from bench.engine import decode_step_ms
from builders import BuildOptions, build_engine
from torch_engine.config import DType, EngineConfig, PrefixCacheConfig, WeightStorage
from torch_engine.cpu import cpu_info
from torch_engine.engine import LLMEngine

ENGINE = Path("/tmp/dense-fp32/engine")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--march", default=None, help="build the kernels for this -march (default: this CPU)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("out", type=Path)
    a = p.parse_args()
    if a.march:
        tk.use_march(a.march)
    if not (ENGINE / "engine.json").exists():
        opts = BuildOptions(dtype=DType.FLOAT32, page_size=16, weights=WeightStorage.DENSE)
        build_engine("smollm2", ENGINE, opts, progress=False)
    result: dict[str, object] = {"cpu": cpu_info().as_dict(), "march": a.march or "native"}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["when"] = when
    for threads in a.threads:
        torch.set_num_threads(threads)
        engines = {
            fused: LLMEngine(
                EngineConfig(engine_dir=ENGINE, fast_cpu=True, dtype=DType.FLOAT32, fused_decode=fused,
                             num_pages=1024, prefix_cache=PrefixCacheConfig(enabled=False))
            )
            for fused in (False, True)
        }  # fmt: skip
        result["kernel_path"] = engines[True].kernel_path
        for batch in a.batches:
            runs: dict[bool, list[float]] = {False: [], True: []}
            for i in range(5):
                for fused in (False, True) if i % 2 == 0 else (True, False):
                    runs[fused].append(decode_step_ms(engines[fused], batch))
            eager, fused_ms = statistics.median(runs[False]), statistics.median(runs[True])
            pairs = statistics.median(e / f for e, f in zip(runs[False], runs[True], strict=True))
            result[f"{threads}t b{batch}"] = {
                "eager_ms": eager,
                "fused_ms": fused_ms,
                "pair_ratio": pairs,
                "runs": runs,
            }
            print(
                f"threads {threads} batch {batch}: eager {eager:.1f} ms, fused {fused_ms:.1f} ms, x{pairs:.2f}",
                flush=True,
            )
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Eager vs compiled decode step on SmolLM2 built dense bf16 (an HF checkpoint's kind of engine), side by side:
the same engine with ``fused_decode`` off and on, alternated, medians of 3; prompt 256, 32 decode steps.

Run from the repository root: ``.venv/bin/python benchmarks/fused-dense-2026-12-02/run.py [OUT.json]``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from bench.engine import decode_step_ms
from builders import BuildOptions, build_engine
from torch_engine.config import DType, EngineConfig, PrefixCacheConfig, WeightStorage
from torch_engine.engine import LLMEngine

ENGINE = Path("/tmp/dense/engine")


def main(out: Path) -> None:
    if not (ENGINE / "engine.json").exists():
        opts = BuildOptions(dtype=DType.BFLOAT16, page_size=16, weights=WeightStorage.DENSE)
        build_engine("smollm2", ENGINE, opts, progress=False)
    result: dict[str, dict[str, float]] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        engines = {
            fused: LLMEngine(
                EngineConfig(engine_dir=ENGINE, fast_cpu=True, dtype=DType.BFLOAT16, fused_decode=fused,
                             num_pages=1024, prefix_cache=PrefixCacheConfig(enabled=False))
            )
            for fused in (False, True)
        }  # fmt: skip
        for batch in (1, 8, 16):
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(3):
                for fused, engine in engines.items():
                    runs[fused].append(decode_step_ms(engine, batch))
            eager, fused_ms = statistics.median(runs[False]), statistics.median(runs[True])
            result[f"{threads}t b{batch}"] = {"eager_ms": eager, "fused_ms": fused_ms}
            ratio = eager / fused_ms
            print(f"threads {threads} batch {batch}: eager {eager:.1f} ms, fused {fused_ms:.1f} ms, x{ratio:.2f}")
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dense/result.json"))

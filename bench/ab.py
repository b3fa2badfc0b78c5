"""Two engines side by side in one process, alternated: the A/B of a dated benchmark (``benchmarks/``).

On the small, shared machines this project is measured on, single runs drift by tens of percent from one
minute to the next; a change is measured by alternating both sides (which goes first alternates too) and
taking the median of the pairs' ratios. Points: decode steps at each batch (``decode_step_ms``: prompt 256,
32 steps) and prefill of one 256-token prompt (computed: the engines should run without the prefix cache).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from bench.engine import decode_step_ms
from torch_engine.config import EngineConfig, PrefixCacheConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams


def prefill_tok_s(engine: LLMEngine, length: int = 256) -> float:
    """Tokens a second of one ``length``-token prompt's prefill (random tokens, seeded)."""
    prompt = [int(v) for v in torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(7))]
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return length / (time.perf_counter() - t)


def alternate(new: tuple[str, LLMEngine], old: tuple[str, LLMEngine], batches: list[int],
              pairs: int = 5) -> dict[str, dict[str, object]]:  # fmt: skip
    """For ``b{batch}`` (step ms) and ``prefill`` (tok/s): each side's median over ``pairs`` alternated runs
    (under its name), ``speedup`` (the median of the pairs' new-over-old speed ratios) and the ``runs``."""
    out: dict[str, dict[str, object]] = {}
    points: dict[str, int | None] = {f"b{b}": b for b in batches} | {"prefill": None}
    for key, batch in points.items():
        runs: dict[str, list[float]] = {new[0]: [], old[0]: []}
        for i in range(pairs):
            for name, engine in (new, old) if i % 2 == 0 else (old, new):
                runs[name].append(decode_step_ms(engine, batch) if batch is not None else prefill_tok_s(engine))
        ratios = [
            o / n if batch is not None else n / o for n, o in zip(runs[new[0]], runs[old[0]], strict=True)
        ]  # fmt: skip
        unit = "ms" if batch is not None else "tok/s"
        out[key] = {new[0]: statistics.median(runs[new[0]]), old[0]: statistics.median(runs[old[0]]),
                    "speedup": statistics.median(ratios), "unit": unit, "runs": runs}  # fmt: skip
        print(f"{key}: {new[0]} {out[key][new[0]]:.2f} {unit}, {old[0]} {out[key][old[0]]:.2f} {unit}, "
              f"x{out[key]['speedup']:.2f}", flush=True)  # fmt: skip
    return out


def compare(new: tuple[str, Path], old: tuple[str, Path], threads: list[int], batches: list[int]) -> dict[str, object]:
    """Two engine directories on the fast CPU path without the prefix cache, ``alternate``d at each thread count:
    ``kernel_path`` (each side's) and ``{threads}t {point}``."""
    out: dict[str, object] = {}
    for n in threads:
        torch.set_num_threads(n)
        engines = [
            (name, LLMEngine(EngineConfig(engine_dir=d, fast_cpu=True, num_pages=1024,
                                          prefix_cache=PrefixCacheConfig(enabled=False))))
            for name, d in (new, old)
        ]  # fmt: skip
        out["kernel_path"] = {name: e.kernel_path for name, e in engines}
        print(f"threads {n}: {out['kernel_path']}", flush=True)
        out |= {f"{n}t {key}": point for key, point in alternate(engines[0], engines[1], batches).items()}
    return out

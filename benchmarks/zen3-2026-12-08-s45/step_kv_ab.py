"""The decode step of two builds of the CPU kernels, each over fp32 and bf16 KV pages, alternated in one process.

Four engines of the embedded SmolLM2 (prompts of 256 tokens, ``--batch`` requests each): the old and the new build
(``benchmarks/xeon-2026-12-07-s40/build_named.py``: a name of their own), each with pages in the compute dtype (fp32
on an AVX2-only CPU) and in bf16 (``EngineConfig.kv_dtype``). Every round steps each engine ``--steps`` times, the
engines in another order each round; printed: each engine's median step and the medians (and ranges) of the rounds'
paired ratios against the old build's fp32 pages and against the old build on the same pages. Session 45
(AVX2-only Zen 3), step_kv_ab.txt:

    git worktree add /tmp/wt-old f09a2a1
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py /tmp/wt-old dck_old /tmp/build_old
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py . dck_new /tmp/build_new
    .venv/bin/python benchmarks/zen3-2026-12-08-s45/step_kv_ab.py --old /tmp/build_old/dck_old.so \\
        --new /tmp/build_new/dck_new.so --threads 1 --batch 1 8 16
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import random
import statistics
import time
from types import ModuleType

import torch

import torch_engine.kernels as tk
from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

SIDES = [("old", None), ("old", "bfloat16"), ("new", None), ("new", "bfloat16")]


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(os.path.basename(path).split(".")[0], path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(module: ModuleType, a: argparse.Namespace, batch: int, kv: str | None) -> LLMEngine:
    tk.build = lambda *args, **kw: module  # this engine's kernels
    tk.cpu_kernels.cache_clear()
    tokens = a.rounds * a.steps + 8
    opts = Options(engine_dir_of(a), "cpu", "auto", [a.threads], 256, tokens, [batch], 1, False, None)
    engine = _engine(dataclasses.replace(opts, kv_dtype=kv))
    assert tk.cpu_kernels() is module
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    vocab = engine.describe().model.vocab_size
    ids = [engine.add_request(p, params) for p in _prompts(batch, 256, vocab, 7)]
    while not all(engine.request(i).output_ids for i in ids):
        engine.step()
    return engine


def name(side: tuple[str, str | None]) -> str:
    return f"{side[0]} {'bf16' if side[1] else 'fp32'} pages"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    modules = {"old": load(a.old), "new": load(a.new)}
    assert modules["old"] is not modules["new"], "one module for both: give the builds names of their own"
    order = list(range(len(SIDES)))
    shuffle = random.Random(1)
    for batch in a.batch:
        engines = [make(modules[s[0]], a, batch, s[1]) for s in SIDES]
        for s, e in zip(SIDES, engines, strict=True):
            d = e.describe()
            print(f"# {name(s)}: dtype {d.dtype}, pages {d.kv_dtype}, {d.kernel_path}")
        times: list[list[float]] = [[] for _ in SIDES]
        for _ in range(a.rounds):
            shuffle.shuffle(order)
            for i in order:
                ts = []
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    engines[i].step()
                    ts.append(time.perf_counter() - t0)
                times[i].append(statistics.median(ts))
        for i, s in enumerate(SIDES):
            vs_old = [t0 / t for t0, t in zip(times[0], times[i], strict=True)]
            vs_same = [t0 / t for t0, t in zip(times[i % 2], times[i], strict=True)]
            print(
                f"threads {a.threads} batch {batch:2d} {name(s)}: {1e3 * statistics.median(times[i]):6.2f} ms; "
                f"old fp32 / this {statistics.median(vs_old):.3f} ({min(vs_old):.3f}-{max(vs_old):.3f}), "
                f"old same pages / this {statistics.median(vs_same):.3f} ({min(vs_same):.3f}-{max(vs_same):.3f})",
                flush=True,
            )
        del engines


if __name__ == "__main__":
    main()

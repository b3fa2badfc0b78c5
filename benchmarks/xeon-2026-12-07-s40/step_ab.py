"""The decode step of two builds of the CPU kernels alternated in one process (session 40, step_ab.txt).

Launches of one tree moved a batch-16 step 36-50 ms on the Emerald Rapids VM, so two trees are compared inside one
process: each build (``build_named.py``: a name of its own) serves an engine of the embedded SmolLM2 (prompts of 256
tokens), and the two engines' steps alternate, ``--steps`` at a time, which goes first alternating too; printed: each
side's median step and the median (and range) of the rounds' old / new ratios.

    git worktree add /tmp/wt-old 8c7c6c1
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py /tmp/wt-old dck_old /tmp/build_old
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py . dck_new /tmp/build_new
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/step_ab.py --old /tmp/build_old/dck_old.so \\
        --new /tmp/build_new/dck_new.so --threads 1 --batch 1 8 16
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from types import ModuleType

import torch

import torch_engine.kernels as tk
from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(os.path.basename(path).split(".")[0], path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(module: ModuleType, a: argparse.Namespace, batch: int) -> LLMEngine:
    tk.build = lambda *args, **kw: module  # this engine's kernels
    tk.cpu_kernels.cache_clear()
    tokens = 2 * a.rounds * a.steps + 8
    engine = _engine(Options(engine_dir_of(a), "cpu", "auto", [a.threads], 256, tokens, [batch], 1, False, None))
    assert tk.cpu_kernels() is module
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    vocab = engine.describe().model.vocab_size
    ids = [engine.add_request(p, params) for p in _prompts(batch, 256, vocab, 7)]
    while not all(engine.request(i).output_ids for i in ids):
        engine.step()
    return engine


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
    for batch in a.batch:
        engines = {side: make(modules[side], a, batch) for side in ("old", "new")}
        times: dict[str, list[float]] = {"old": [], "new": []}
        ratios = []
        for r in range(a.rounds):
            median = {}
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                ts = []
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    engines[side].step()
                    ts.append(time.perf_counter() - t0)
                median[side] = statistics.median(ts)
                times[side].append(median[side])
            ratios.append(median["old"] / median["new"])
        print(
            f"threads {a.threads} batch {batch}: old {1e3 * statistics.median(times['old']):.2f} ms, "
            f"new {1e3 * statistics.median(times['new']):.2f} ms, old/new median of {a.rounds} paired rounds "
            f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )
        del engines


if __name__ == "__main__":
    main()

"""Where a decode step's time goes (session 42, phases.txt): the engine's step against its fused call and its logits.

The engine of the embedded SmolLM2 (prompts of 256 tokens) runs ``--steps`` decode steps at each batch; printed: the
step's median, and per step the fused call (``FusedStep.run``), the logits (``ModelRunner.logits``) and the rest
(scheduling, sampling, outputs). The per-phase figures of phases.txt came from a one-off build of decode_step.cpp
with a timer after each barrier of the layer loop, loaded in place of the kernels (``--kernels``, a module built by
``benchmarks/xeon-2026-12-07-s40/build_named.py``).

    taskset -c 1 .venv/bin/python benchmarks/xeon-2026-12-07-s42/phases.py --threads 1 --batch 1 8 16

``--kv-dtype`` (session 45) sets the KV pages' dtype (default: the engine's choice); session 45's phases.txt compared
timed builds (session 43's ``timed_tree.py``) of two trees on fp32 and bf16 pages:

    taskset -c 1 .venv/bin/python benchmarks/xeon-2026-12-07-s42/phases.py --threads 1 --batch 1 16 \
        --kernels /tmp/build_timed_new/dck_timed_new.so --kv-dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import torch_engine.fused_step as fs
import torch_engine.kernels as tk
import torch_engine.model_runner as mr
from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.sampling import SamplingParams

spent: dict[str, float] = {}


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return out

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kernels", help="a kernels module (.so) to load instead of the tree's build")
    p.add_argument("--kv-dtype", help="the KV pages' dtype (float32 / bfloat16; default: the engine's choice)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.kernels:
        spec = importlib.util.spec_from_file_location(os.path.basename(a.kernels).split(".")[0], a.kernels)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        tk.build = lambda *args, **kw: module
        tk.cpu_kernels.cache_clear()
    fs.FusedStep.run = timed("fused", fs.FusedStep.run)  # type: ignore[method-assign]
    mr.ModelRunner.logits = timed("logits", mr.ModelRunner.logits)  # type: ignore[method-assign]
    for batch in a.batch:
        opts = Options(engine_dir_of(a), "cpu", "auto", [a.threads], 256, a.steps + 80, [batch], 1, False, None)
        engine = _engine(dataclasses.replace(opts, kv_dtype=a.kv_dtype))
        print(f"# pages {engine.describe().kv_dtype}, {engine.describe().kernel_path}", flush=True)
        vocab = engine.describe().model.vocab_size
        params = SamplingParams(max_tokens=a.steps + 60, ignore_eos=True)
        ids = [engine.add_request(prompt, params) for prompt in _prompts(batch, 256, vocab, 7)]
        while not all(engine.request(i).output_ids for i in ids):
            engine.step()
        for _ in range(5):
            engine.step()
        spent.clear()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        n, total = a.steps, sum(times)
        rest = total - spent["fused"] - spent["logits"]
        print(
            f"batch {batch}: step median {1e3 * statistics.median(times):.2f} ms; per step fused "
            f"{1e3 * spent['fused'] / n:.2f}, logits {1e3 * spent['logits'] / n:.2f}, rest {1e3 * rest / n:.2f} ms",
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main()

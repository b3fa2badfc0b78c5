"""A whole prefill of the embedded SmolLM2 (Q4_1, bf16 ``auto``) on two builds of the CPU kernels, alternated in one
process (session 41, prefill_engine_ab.txt): each round each engine prefills a fresh prompt of L tokens (its own
random ids: no prefix-cache hit) to its first token; printed: each side's median and the median (and range) of the
rounds' old / new ratios. Builds and engines as ``benchmarks/xeon-2026-12-07-s40/step_ab.py`` makes them.

    .venv/bin/python benchmarks/xeon-2026-12-07-s41/prefill_engine_ab.py --old /tmp/build_old/dck_old.so \\
        --new /tmp/build_pf/dck_pf.so --lengths 256 1024 2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "xeon-2026-12-07-s40"))
from step_ab import load, make

from builders.arguments import engine_source_arguments
from torch_engine.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    a.steps = max(a.lengths) // 2 + 64  # make() sizes the KV pool for 256 + 2 * rounds * steps tokens
    torch.set_num_threads(a.threads)
    modules = {"old": load(a.old), "new": load(a.new)}
    engines = {side: make(modules[side], a, 1) for side in ("old", "new")}
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for n in a.lengths:
        times: dict[str, list[float]] = {"old": [], "new": []}
        ratios = []
        for r in range(a.rounds):
            took = {}
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                engine = engines[side]
                prompt = torch.randint(100, 40_000, (n,), generator=gen).tolist()
                t0 = time.perf_counter()
                rid = engine.add_request(prompt, params)
                while not engine.request(rid).output_ids:
                    engine.step()
                took[side] = time.perf_counter() - t0
                times[side].append(took[side])
                while not engine.request(rid).finished:
                    engine.step()
            ratios.append(took["old"] / took["new"])
        print(
            f"threads {a.threads} prefill {n} tokens: old {1e3 * statistics.median(times['old']):.0f} ms, "
            f"new {1e3 * statistics.median(times['new']):.0f} ms, old/new median of {a.rounds} paired rounds "
            f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Prefill before / after this session's changes (the compiled row ops, afdbff7; the bf16 prefill attention,
its next commit), two source trees in alternated processes.

Each process (``--child``) runs one point on its tree's code and kernels and prints it:
- ``prefill FILE THREADS TOKENS``: the engine of a file (the embedded Q4_1, or llama.cpp's Q4_K_M of it), two
  prefills to warm up, then the median of 7 prefills of one prompt (tokens a second, no prefix cache);
- ``attention TOKENS THREADS``: the compiled prefill attention alone on SmolLM2's shapes (9 query heads on 3 KV
  heads of 64, bf16 pages, one chunk from position 0), the median of 9 calls (ms).
The parent alternates the trees for ``--pairs`` pairs per point: medians of each side, and the median of the pairs'
ratios (> 1: faster now). Across processes this machine's noise is ~±15 %: the pairs are what make the ratio.

Run from the repository root, with the older commit checked out beside it (``git worktree add /tmp/old afdbff7~1``):
``.venv/bin/python benchmarks/row-ops-2026-12-04/run.py --old-tree /tmp/old OUT.json``. Needs llama.cpp's binding
(``make bench-peers``) to write the Q4_K_M file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path("/tmp/row-ops")
HERE = Path(__file__).resolve()


def child_prefill(model: str, threads: int, tokens: int) -> float:
    import torch

    from bench.ab import prefill_tok_s
    from builders import BuildOptions, build_engine
    from builders.embedded import smollm2_gguf
    from torch_engine.config import NO_PREFIX_CACHE, EngineConfig, SchedulerConfig
    from torch_engine.engine import LLMEngine

    torch.set_num_threads(threads)
    src = str(smollm2_gguf()) if model == "Q4_1" else str(ROOT / f"smollm2-{model.lower()}.gguf")
    engine_dir = build_engine(src, ROOT / f"engine-{model.lower()}", BuildOptions(), progress=False)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=tokens, max_prefill_chunk=tokens)
    pages = tokens // 16 + 8
    cfg = EngineConfig(
        engine_dir=engine_dir, dtype="auto", num_pages=pages, prefix_cache=NO_PREFIX_CACHE, scheduler=sched
    )
    engine = LLMEngine(cfg, load_tokenizer=False)
    for _ in range(2):
        prefill_tok_s(engine, tokens)
    return statistics.median(prefill_tok_s(engine, tokens) for _ in range(7))


def child_attention(tokens: int, threads: int) -> float:
    import torch

    from torch_engine.config import KVLayout
    from torch_engine.kernels import cpu_kernels
    from torch_engine.kv_cache import KVCacheSpec, PagedKVCache

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    pages = tokens // 16
    kv = PagedKVCache(KVCacheSpec(1, pages, 16, KVLayout.HND, torch.bfloat16, kv_heads=3, head_dim=64))
    kv.pools[0].copy_(torch.randn(kv.pools[0].shape).bfloat16())
    kv.kernels = cpu_kernels()
    table, q = torch.randperm(pages)[None], torch.randn(tokens, 9, 64).bfloat16()
    times = []
    for _ in range(11):
        t = time.perf_counter()
        kv.prefill_attention(0, q, table, 0, 0.125)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3


def measure(tree: Path, point: list[str]) -> float:
    env = os.environ | {"PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(HERE), "--child", *point]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--old-tree", type=Path)
    p.add_argument("--files", nargs="+", default=["Q4_1", "Q4_K_M"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("out", type=Path, nargs="?")
    a = p.parse_args()
    if a.child:
        what, *args = a.child
        v = (
            child_prefill(args[0], int(args[1]), int(args[2]))
            if what == "prefill"
            else child_attention(*map(int, args))
        )
        print(json.dumps(v))
        return
    from bench.gguf_rewrite import llama_quantize
    from builders.embedded import smollm2_gguf
    from torch_engine.cpu import cpu_info

    ROOT.mkdir(parents=True, exist_ok=True)
    for f in a.files:
        if f != "Q4_1" and not (ROOT / f"smollm2-{f.lower()}.gguf").exists():
            llama_quantize(smollm2_gguf(), ROOT / f"smollm2-{f.lower()}.gguf", f)
    trees = {"new": HERE.parents[2], "old": a.old_tree.resolve()}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result: dict[str, object] = {"cpu": cpu_info().as_dict(), "when": when}
    points = [["attention", str(n), str(t)] for n in a.tokens for t in a.threads]
    points += [["prefill", f, str(t), str(n)] for f in a.files for n in a.tokens for t in a.threads]
    for point in points:
        runs: dict[str, list[float]] = {"new": [], "old": []}
        for i in range(a.pairs):
            for side in ("new", "old") if i % 2 == 0 else ("old", "new"):
                runs[side].append(measure(trees[side], point))
        pairs = zip(runs["new"], runs["old"], strict=True)
        speedup = statistics.median(o / n if point[0] == "attention" else n / o for n, o in pairs)
        unit = "ms" if point[0] == "attention" else "tok/s"
        summary = {"new": statistics.median(runs["new"]), "old": statistics.median(runs["old"]), "speedup": speedup}
        result[" ".join(point)] = summary | {"unit": unit, "runs": runs}
        print(" ".join(point), unit, {k: round(v, 3) for k, v in summary.items()}, flush=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

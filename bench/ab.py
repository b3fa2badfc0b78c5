"""Two engines side by side in one process, alternated: the A/B of a dated benchmark (``benchmarks/``).

On the small, shared machines this project is measured on, single runs drift by tens of percent from one
minute to the next; a change is measured by alternating both sides (which goes first alternates too) and
taking the median of the pairs' ratios. Points: decode steps at each batch (``decode_step_ms``: prompt 256,
32 steps) and prefill of one 256-token prompt (computed: the engines should run without the prefix cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from bench.engine import decode_step_ms
from torch_engine.config import EngineConfig, PrefixCacheConfig
from torch_engine.cpu import cpu_info
from torch_engine.engine import LLMEngine
from torch_engine.quant import Grouped, Packed, group
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


def compare_files(
    root: Path, ftype: str, as_before: Callable[[Path, Path], int], threads: list[int], batches: list[int]
) -> dict[str, object]:
    """llama.cpp's ``ftype`` mix of the embedded SmolLM2 (``root / smollm2-<ftype>.gguf``, written by its quantizer
    if absent: ``make bench-peers``) against ``as_before``'s copy of it (the tensors an older builder made something
    else of, rewritten as it did; it returns how many), both built under ``root`` (fp32, as stored) and
    ``compare``d: ``tensors_rewritten``, ``file_bytes``, each side's ``engine_bytes`` and ``conversion_error``, then
    the points. Sides: ``kept`` (the file) and ``before`` (the copy)."""
    from bench.gguf_rewrite import llama_quantize
    from builders import BuildOptions, build_engine
    from builders.embedded import smollm2_gguf
    from torch_engine.config import DType, EngineManifest

    src, old = root / f"smollm2-{ftype.lower()}.gguf", root / f"smollm2-{ftype.lower()}-before.gguf"
    if not src.exists():
        llama_quantize(smollm2_gguf(), src, ftype)
    n = as_before(src, old)
    opts = BuildOptions(dtype=DType.FLOAT32)
    dirs = {
        side: build_engine(str(path), root / f"engine-{ftype.lower()}-{side}", opts, progress=False)
        for side, path in (("kept", src), ("before", old))
    }
    info: dict[str, object] = {
        "tensors_rewritten": n,
        "file_bytes": src.stat().st_size,
        "engine_bytes": {s: (d / "rank0.safetensors").stat().st_size for s, d in dirs.items()},
        "conversion_error": {s: EngineManifest.load(d).conversion_error for s, d in dirs.items()},
    }
    print(ftype, info, flush=True)
    return info | compare(("kept", dirs["kept"]), ("before", dirs["before"]), threads, batches)


def gemm_args(rows: list[int]) -> tuple[argparse.Namespace, ModuleType]:
    """A GEMM benchmark's command line (``--threads``, ``--rows``, ``--march``: the kernels that instruction-set level
    builds, run on this CPU) and those kernels, the thread count set."""
    import torch_engine.kernels as tk

    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=rows)
    p.add_argument("--march", default=None)
    a = p.parse_args()
    if a.march:
        tk.use_march(a.march)
    kernels = tk.cpu_kernels()
    assert kernels is not None, "the kernels cannot be built here"
    torch.set_num_threads(a.threads)
    return a, kernels


def main_files(root: Path, as_before: Callable[[Path, Path], int], files: list[str]) -> None:
    """A dated engine A/B's command line (``OUT.json [--threads 1 2] [--batches 1 8 16] [--files ...]``):
    ``compare_files`` for each file, the CPU and the time beside them in ``OUT.json``."""
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--files", nargs="+", default=files)
    p.add_argument("out", type=Path)
    a = p.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result: dict[str, object] = {"cpu": cpu_info().as_dict(), "when": when}
    for ftype in a.files:
        result[ftype] = compare_files(root, ftype, as_before, a.threads, a.batches)
    a.out.write_text(json.dumps(result, indent=1))


def time_gemm_sets(
    sets: dict[str, tuple[tuple[int, int], int]], sides: Sequence[str],
    forms: Callable[[torch.Tensor], Sequence[Packed]], rows: list[int] | None = None,
) -> None:  # fmt: skip
    """A dated GEMM benchmark (``gemm_args``' command line): for each set ``name: ((n, k), count)``, ``count`` random
    ``[n, k]`` weights (standard normal x 0.05) in each side's form (``forms`` of one weight, in ``sides``' order),
    each side's GEMMs timed in turn (the order rotated every round), medians over 9 rounds (5 past 16 rows); prints
    each side's MB and time and the other sides' times over the first's."""
    a, kernels = gemm_args(rows=rows or [1, 8, 64, 256])
    rng = np.random.default_rng(0)
    for name, ((n, k), count) in sets.items():
        grouped: dict[str, list[Grouped]] = {s: [] for s in sides}
        for _ in range(count):
            w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
            for side, packed in zip(sides, forms(w), strict=True):
                grouped[side].append(group(packed, kernels))
        mb = {s: round(sum(g.nbytes for g in gs) / 1e6, 1) for s, gs in grouped.items()}
        print({"set": name, "march": a.march or "native", "i8_path": kernels.i8_path(), "threads": a.threads,
               "MB": mb}, flush=True)  # fmt: skip
        empty = torch.empty(0)
        order = list(sides)
        for r in a.rows:
            x = torch.randn(r, k)
            times: dict[str, list[float]] = {s: [] for s in sides}
            for i in range(9 if r <= 16 else 5):
                for s in order[i % len(order) :] + order[: i % len(order)]:
                    t = time.perf_counter()
                    for g in grouped[s]:
                        g.gemm(kernels, x, empty)
                    times[s].append((time.perf_counter() - t) * 1e3)
            med = {s: statistics.median(v) for s, v in times.items()}
            ratios = "  ".join(f"{s} / {order[0]} {med[s] / med[order[0]]:.2f}" for s in order[1:])
            print(f"  rows {r}: " + "  ".join(f"{s} {v:.2f} ms" for s, v in med.items()) + "  " + ratios, flush=True)

"""The engine's AVX2 kernels (what an AVX2-only CPU such as a Zen 3 builds) measured on this AVX-512 machine,
beside the kernels built for it: the same SmolLM2 Q4_1 engine, one subprocess per configuration (two builds
of one extension cannot share a process), configurations alternated, medians of 3; prompt 256, 32 decode
steps. An AVX2-only CPU runs the engine in fp32 (``dtype: auto``: no native bf16 dot product), so the AVX2
build runs fp32; the native build runs both fp32 and its own ``auto`` (bf16 here). Not a measurement *of* an
AVX2 CPU (this core's clock, caches and memory are not a Zen 3's): of the AVX2 code paths, on one core type.

Run from the repository root: ``.venv/bin/python benchmarks/avx2-path-2026-12-02/run.py [OUT.json]``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"native/auto": ("native", "auto"), "native/fp32": ("native", "float32"), "avx2/fp32": ("avx2", "float32")}
LEVEL = "x86-64-v3"  # AVX2 + FMA + F16C, tuned for this CPU (torch_engine.kernels.use_march)


def one(isa: str, dtype: str, threads: int, batches: list[int]) -> dict[str, object]:
    """Decode-step milliseconds per batch of one configuration (run in its own process)."""
    import torch_engine.kernels as tk

    if isa == "avx2":
        tk.use_march(LEVEL)
    import argparse

    from bench import engine as be
    from builders.arguments import engine_dir_of, engine_source_arguments
    from torch_engine.config import DType

    p = argparse.ArgumentParser()
    engine_source_arguments(p, DType.FLOAT32)
    torch.set_num_threads(threads)
    opts = be.Options(engine_dir_of(p.parse_args([])), "cpu", dtype, [threads], 256, 32, batches, 1, False, None, None,
                      False, False, False)  # fmt: skip
    engine = be._engine(opts)
    steps: dict[str, float] = {}
    prefill: dict[str, float] = {}
    for b in batches:
        prompts = be._prompts(b, 256, engine.describe().model.vocab_size, b)
        be.engine_run(engine, prompts, 32)
        runs = [be.engine_run(engine, prompts, 32) for _ in range(3)]
        steps[str(b)] = 1e3 * statistics.median(r[1] for r in runs) / 32
        prefill[str(b)] = b * 256 / statistics.median(r[0] for r in runs)
    return {"kernel_path": engine.kernel_path, "step_ms": steps, "prefill_tok_s": prefill}


def main(out: Path) -> None:
    from torch_engine.cpu import cpu_info
    from torch_engine.kernels import build

    build(march=LEVEL)  # built once, before any timing
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result: dict[str, object] = {"cpu": cpu_info().as_dict(), "when": when}
    for threads in (1, 2):
        runs: dict[str, list[dict[str, object]]] = {name: [] for name in CONFIGS}
        for _ in range(3):
            for name, (isa, dtype) in CONFIGS.items():
                cmd = [sys.executable, __file__, "--one", isa, dtype, str(threads), "1", "8"]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        table: dict[str, object] = {}
        for name, rs in runs.items():
            table[name] = {
                "kernel_path": rs[0]["kernel_path"],
                "step_ms": {b: statistics.median(r["step_ms"][b] for r in rs) for b in ("1", "8")},  # type: ignore[index]
                "prefill_tok_s": {b: statistics.median(r["prefill_tok_s"][b] for r in rs) for b in ("1", "8")},  # type: ignore[index]
            }
            print(f"threads {threads} {name:12s} {table[name]}", flush=True)
        result[f"threads_{threads}"] = table
    out.write_text(json.dumps(result, indent=2), encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        isa, dtype, threads, *batches = sys.argv[2:]
        print(json.dumps(one(isa, dtype, int(threads), [int(b) for b in batches])))
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "avx2-path-2026-12-02" / "avx2.json")

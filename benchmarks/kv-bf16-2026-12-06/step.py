"""The median decode step (ms) of ``--batch`` requests after their 256-token prompts, with the KV pages in the
compute dtype and in ``--kv-dtype``, alternated in one process (``--rounds`` rounds, each engine's best round)."""

from __future__ import annotations

import argparse
import dataclasses
import random

import torch

from bench.engine import Options, _engine
from bench.profile import decode_time
from builders.arguments import engine_dir_of, engine_source_arguments


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dtype", default="bfloat16")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    top = max(a.batch)
    engines = {}
    for kv in (None, a.kv_dtype):
        opts = Options(engine_dir_of(a), "cpu", "auto", [a.threads], 256, a.steps + 2, [top], 1, False, None)
        engines[kv] = _engine(dataclasses.replace(opts, kv_dtype=kv))
    for kv, e in engines.items():
        d = e.describe()
        print(f"# KV {kv or 'compute dtype'}: dtype {d.dtype}, pages {d.kv_dtype}, {d.kv_bytes_per_token} B/token, "
              f"{d.kernel_path}")  # fmt: skip
    for batch in a.batch:
        best: dict[str | None, float] = {}
        for _ in range(a.rounds):
            for kv, e in engines.items():
                ms = 1e3 * decode_time(e, batch, 256 + a.steps // 2, a.steps, random.Random(7))  # 256-token prompts
                best[kv] = min(best.get(kv, ms), ms)
        base, other = best[None], best[a.kv_dtype]
        print(
            f"batch {batch:3d} threads {a.threads}: step {base:7.2f} ms (KV as computed) vs {other:7.2f} ms "
            f"(KV {a.kv_dtype}): x{base / other:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""The median decode step (ms) of ``--batch`` requests after their 256-token prompts (``step_ab.sh``)."""

from __future__ import annotations

import argparse
import time

import torch

from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=48)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    engine = _engine(Options(engine_dir_of(a), "cpu", "auto", [a.threads], 256, a.steps + 2, [a.batch], 1, False, None))
    params = SamplingParams(max_tokens=a.steps + 2, ignore_eos=True)
    vocab = engine.describe().model.vocab_size
    ids = [engine.add_request(prompt, params) for prompt in _prompts(a.batch, 256, vocab, 7)]
    while not all(engine.request(i).output_ids for i in ids):
        engine.step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    print(f"{1e3 * sorted(times)[len(times) // 2]:.2f}")


if __name__ == "__main__":
    main()

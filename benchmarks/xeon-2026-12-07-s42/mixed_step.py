"""A mixed step (B decoding streams and one new prompt in the same step) against its parts (session 42, mixed_step.txt).

The planner prices a mixed step as the decode step plus the prefill's time above a one-token step
(``planner.profile.CostModel.step_s``); this measures the engine's: B streams of 64-token prompts decode (5 steps
timed), then a prompt of ``--prompt`` tokens arrives and the next step (the mixed one) is timed. The embedded SmolLM2
(Q4_1, bf16 ``auto``), one thread, four repeats a batch (B = 0: the prompt alone).

    taskset -c 1 .venv/bin/python benchmarks/xeon-2026-12-07-s42/mixed_step.py --batch 0 1 4 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--batch", type=int, nargs="+", default=[0, 1, 4, 8])
    p.add_argument("--prompt", type=int, default=128)
    a = p.parse_args()
    torch.set_num_threads(1)
    engine = _engine(Options(engine_dir_of(a), "cpu", "auto", [1], 256, 400, [16], 1, False, None))
    vocab = engine.describe().model.vocab_size
    print(engine.describe().kernel_path, flush=True)
    for batch in a.batch:
        for rep in range(4):
            streams = SamplingParams(max_tokens=300, ignore_eos=True)
            ids = [engine.add_request(q, streams) for q in _prompts(batch, 64, vocab, 3 + rep)] if batch else []
            while not all(engine.request(i).output_ids for i in ids):
                engine.step()
            decode = []
            for _ in range(5):
                t0 = time.perf_counter()
                engine.step()
                decode.append(time.perf_counter() - t0)
            prompt = _prompts(1, a.prompt, vocab, 99 + rep)[0]
            new = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            t0 = time.perf_counter()
            engine.step()
            mixed = time.perf_counter() - t0
            done = bool(engine.request(new).output_ids)
            step = 1e3 * statistics.median(decode) if batch else 0.0
            print(
                f"B={batch}: decode step {step:.1f} ms, the step with the {a.prompt}-token prompt "
                f"{1e3 * mixed:.1f} ms (its first token out: {done})",
                flush=True,
            )
            for i in ids:
                engine.abort(i)
            while engine.has_unfinished():
                engine.step()


if __name__ == "__main__":
    main()

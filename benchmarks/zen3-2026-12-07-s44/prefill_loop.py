"""Prefills for a profiler (session 44): the embedded engine on one thread, fresh prompts of --len tokens to their first
token, printed each one's seconds.

    taskset -c 1 perf record -F 2000 -g .venv/bin/python benchmarks/zen3-2026-12-07-s44/prefill_loop.py --n 16
"""

import argparse
import time

import torch

from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.sampling import SamplingParams

p = argparse.ArgumentParser(description=__doc__)
engine_source_arguments(p)
p.add_argument("--n", type=int, default=12)
p.add_argument("--len", type=int, default=256)
a = p.parse_args()
torch.set_num_threads(1)
engine = _engine(Options(engine_dir_of(a), "cpu", "auto", [1], a.len, 8, [1], 1, False, None))
vocab = engine.describe().model.vocab_size
params = SamplingParams(max_tokens=1, ignore_eos=True)
seconds = []
for prompt in _prompts(a.n, a.len, vocab, 11):
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while not engine.request(rid).output_ids:
        engine.step()
    seconds.append(time.perf_counter() - t0)
print("prefill s:", " ".join(f"{t:.3f}" for t in seconds), flush=True)

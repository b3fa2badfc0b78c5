"""Where a decode step's time goes: engine.step() against the fused call, the logits, the rest."""
import statistics, sys, time
import torch
from bench.engine import Options, _engine, _prompts
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.sampling import SamplingParams
import torch_engine.fused_step as fs
import torch_engine.model_runner as mr
import argparse

acc: dict[str, float] = {}
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); acc[name] = acc.get(name, 0.0) + time.perf_counter() - t; return r
    return w
fs.FusedStep.run = timed("fused", fs.FusedStep.run)
mr.ModelRunner.logits = timed("logits", mr.ModelRunner.logits)

p = argparse.ArgumentParser(); engine_source_arguments(p)
p.add_argument("--threads", type=int, default=1); p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
a = p.parse_args(); torch.set_num_threads(a.threads)
for batch in a.batch:
    engine = _engine(Options(engine_dir_of(a), "cpu", "auto", [a.threads], 256, 200, [batch], 1, False, None))
    vocab = engine.describe().model.vocab_size
    ids = [engine.add_request(p, SamplingParams(max_tokens=120, ignore_eos=True)) for p in _prompts(batch, 256, vocab, 7)]
    while not all(engine.request(i).output_ids for i in ids): engine.step()
    for _ in range(5): engine.step()
    acc.clear(); ts = []
    n = 40
    for _ in range(n):
        t = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t)
    tot = sum(ts)
    print(f"batch {batch}: step median {1e3*statistics.median(ts):.2f} ms; per step fused {1e3*acc['fused']/n:.2f}, logits {1e3*acc['logits']/n:.2f}, rest {1e3*(tot-acc['fused']-acc['logits'])/n:.2f} ms", flush=True)
    del engine

"""Eager vs fused decode step on SmolLM2 dense bf16 (an HF-style dense engine), side by side."""
import json, statistics, sys, time
sys.path.insert(0, "/work/main")
import torch
from pathlib import Path
from builders import BuildOptions, build_engine
from torch_engine.config import WeightStorage
from torch_engine.config import DType, EngineConfig, PrefixCacheConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

out = Path("/tmp/dense/engine")
if not (out / "engine.json").exists():
    build_engine("smollm2", out, BuildOptions(dtype=DType.BFLOAT16, page_size=16, weights=WeightStorage.DENSE), progress=False)

def step_ms(engine, B):
    g = torch.Generator().manual_seed(B)
    ids = [engine.add_request(torch.randint(100, 40000, (256,), generator=g).tolist(),
                              SamplingParams(max_tokens=33, ignore_eos=True)) for _ in range(B)]
    while not all(engine.request(i).output_ids for i in ids):
        engine.step()
    t0 = time.perf_counter(); n = 0
    while engine.has_unfinished():
        engine.step(); n += 1
    dt = (time.perf_counter() - t0) / n
    for i in ids: engine.retire(i)
    return dt * 1000

res = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    engines = {f: LLMEngine(EngineConfig(engine_dir=out, fast_cpu=True, dtype=DType.BFLOAT16, fused_decode=f,
                                         num_pages=1024, prefix_cache=PrefixCacheConfig(enabled=False)))
               for f in (False, True)}
    print(threads, {f: e.kernel_path for f, e in engines.items()}, flush=True)
    for B in (1, 8, 16):
        runs = {False: [], True: []}
        for _ in range(3):
            for f in (False, True):
                runs[f].append(step_ms(engines[f], B))
        m = {f: statistics.median(v) for f, v in runs.items()}
        res[f"{threads}t b{B}"] = m
        print(f"threads {threads} batch {B}: eager {m[False]:.1f} ms, fused {m[True]:.1f} ms, x{m[False]/m[True]:.2f}", flush=True)
json.dump({k: {"eager_ms": v[False], "fused_ms": v[True]} for k, v in res.items()}, open("/tmp/dense/result.json", "w"), indent=1)

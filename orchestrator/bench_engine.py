"""``disagg bench engine``: engine prefill / decode throughput beside HF transformers, and the memory floor.

Everything is measured in one run, same weights, same dtype, same torch threads; engine and HF
alternate ``--repeats`` times per batch size and each figure is the median:

- prefill tokens/s: one step that prefills ``batch`` prompts of ``prompt_len`` tokens
  (engine) vs one HF forward over the same ``[batch, prompt_len]`` ids;
- decode tokens/s: ``decode_tokens`` greedy steps after that prefill (engine) vs HF ``generate``
  with its KV cache (``decode_tokens + 1`` new tokens minus 1 new token);
- the floor of a batch-1 decode step: bytes that one step must read (every weight once, tied
  embeddings once, plus the KV of the context) divided by the memcpy bandwidth measured here
  (bytes copied per second by ``Tensor.copy_`` of a 256 MiB buffer).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second that ``copy_`` moves between two large buffers (each byte read once, written once)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / _median_time(lambda: dst.copy_(src), repeats)


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def engine_run(engine: LLMEngine, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one batch: the first step prefills every prompt."""
    params = SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    assert steps == decode_tokens, f"expected {decode_tokens} decode steps, ran {steps}"
    engine.requests.clear()
    return t1 - t0, t2 - t1


def hf_run(model: torch.nn.Module, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds): one forward over the prompts, and ``generate`` with
    ``decode_tokens + 1`` new tokens minus ``generate`` with 1 (so HF's own prefill cancels out)."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - t0
        decode = gen(decode_tokens + 1) - gen(1)
    return prefill, max(decode, 1e-9)


def load_hf(engine_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from torch_engine.config import EngineManifest

    source = Path(EngineManifest.load(engine_dir).source)
    if source.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    return model.eval()


def run_engine_bench(a: argparse.Namespace, engine_dir_of: Callable[[argparse.Namespace], Path]) -> int:
    torch.set_num_threads(a.threads)
    engine_dir = engine_dir_of(a)
    max_batch = max(a.batch)
    cfg = EngineConfig(
        engine_dir=engine_dir,
        num_threads=a.threads,
        num_pages=max_batch * (-(-(a.prompt_len + a.decode_tokens + 2) // a.page_size)) + 8,
        max_num_seqs=max_batch,
        max_num_batched_tokens=max_batch * a.prompt_len,
        max_prefill_chunk=a.prompt_len,
        page_size=a.page_size,
    )
    engine = LLMEngine(cfg, load_tokenizer=False)
    hf = load_hf(engine_dir, engine.dtype)
    mc = engine.manifest.model
    bandwidth = memcpy_bandwidth()
    wbytes = weight_bytes(engine.model)
    kv_token_bytes = engine.kv.spec.page_bytes // engine.page_size * mc.num_layers
    context = a.prompt_len + a.decode_tokens // 2  # mean context over the decode steps
    floor_s = (wbytes + kv_token_bytes * context) / bandwidth

    engine_run(engine, _prompts(1, 16, mc.vocab_size, 99), 2)  # warm-up
    hf_run(hf, _prompts(1, 16, mc.vocab_size, 99), 2)
    results: dict[str, object] = {
        "model": engine.manifest.source,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": a.threads,
        "prompt_len": a.prompt_len,
        "decode_tokens": a.decode_tokens,
        "repeats": a.repeats,
        "page_size": engine.page_size,
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "memcpy_GBps": bandwidth / 1e9,
        "weight_bytes": wbytes,
        "kv_bytes_per_token": kv_token_bytes,
        "decode_step_floor_ms": floor_s * 1e3,
        "batches": {},
    }
    for batch in a.batch:
        prompts = _prompts(batch, a.prompt_len, mc.vocab_size, batch)
        runs = [
            (engine_run(engine, prompts, a.decode_tokens), hf_run(hf, prompts, a.decode_tokens))
            for _ in range(a.repeats)
        ]
        e_pre, e_dec = (statistics.median(r[0][i] for r in runs) for i in (0, 1))
        h_pre, h_dec = (statistics.median(r[1][i] for r in runs) for i in (0, 1))
        row = {
            "engine_prefill_tok_s": batch * a.prompt_len / e_pre,
            "hf_prefill_tok_s": batch * a.prompt_len / h_pre,
            "engine_decode_tok_s": batch * a.decode_tokens / e_dec,
            "hf_decode_tok_s": batch * a.decode_tokens / h_dec,
            "engine_decode_step_ms": 1e3 * e_dec / a.decode_tokens,
            "hf_decode_step_ms": 1e3 * h_dec / a.decode_tokens,
        }
        row["prefill_ratio_engine_over_hf"] = row["engine_prefill_tok_s"] / row["hf_prefill_tok_s"]
        row["decode_ratio_engine_over_hf"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
        results["batches"][str(batch)] = row  # type: ignore[index]
        print(
            f"batch {batch:>3}: prefill {row['engine_prefill_tok_s']:8.0f} tok/s (HF {row['hf_prefill_tok_s']:8.0f}, "
            f"x{row['prefill_ratio_engine_over_hf']:.2f})  decode {row['engine_decode_tok_s']:7.1f} tok/s "
            f"(HF {row['hf_decode_tok_s']:7.1f}, x{row['decode_ratio_engine_over_hf']:.2f})  "
            f"step {row['engine_decode_step_ms']:.1f} ms"
        )
    batches: dict[str, dict[str, float]] = results["batches"]  # type: ignore[assignment]
    if "1" in batches:
        step1 = batches["1"]["engine_decode_step_ms"]
        results["decode_step_over_floor"] = step1 / results["decode_step_floor_ms"]  # type: ignore[operator]
        goals = {"batch1_decode_at_least_hf": batches["1"]["decode_ratio_engine_over_hf"] >= 1.0}
        goals["batch1_within_1.5x_floor"] = results["decode_step_over_floor"] <= 1.5  # type: ignore[operator]
        if "16" in batches:
            agg = batches["16"]["engine_decode_tok_s"] / batches["1"]["engine_decode_tok_s"]
            results["batch16_over_batch1_decode"] = agg
            goals["batch16_aggregate_at_least_8x"] = agg >= 8.0
        results["goals_met"] = goals
        print(
            f"memcpy {results['memcpy_GBps']:.1f} GB/s, weights {wbytes / 2**20:.0f} MiB: batch-1 decode step "
            f"{step1:.1f} ms vs floor {results['decode_step_floor_ms']:.1f} ms "
            f"(x{results['decode_step_over_floor']:.2f})"
        )
        if "batch16_over_batch1_decode" in results:
            print(f"batch-16 aggregate decode = x{results['batch16_over_batch1_decode']:.1f} batch-1")
        print("goals: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in goals.items()))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0

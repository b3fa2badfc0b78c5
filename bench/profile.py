"""Measure a ``HardwareProfile`` of the engine on this machine (``disagg bench engine --profile``).

- prefill: one prompt of N tokens prefilled in one step (the scheduler's budget and chunk are
  raised to the longest N), the median of ``repeats``;
- decode: B requests of C-token prompts prefilled, then the median of ``steps`` decode steps of
  all B together (the context grows by ``steps`` tokens during them: C is their mean);
- the link: memory copy bandwidth (the KV crosses shared memory here; on a real NIC pass its rate).

The CPU model and flags, the threads, the dtype and the engine's kernel path go into the profile.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from planner.profile import DecodeGrid, HardwareProfile, ProfileSource
from torch_engine.config import NO_PREFIX_CACHE, DType, EngineConfig, EngineManifest, SchedulerConfig
from torch_engine.cpu import cpu_info
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (64, 256, 1024)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def prefill_time(engine: LLMEngine, tokens: int, repeats: int, rng: random.Random) -> float:
    vocab = engine.describe().model.vocab_size
    times = []
    for _ in range(repeats):
        rid = engine.add_request(_prompt(rng, tokens, vocab), SamplingParams(max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        while engine.has_unfinished():
            engine.step()
        engine.retire(rid)
    return statistics.median(times)


def decode_time(engine: LLMEngine, batch: int, context: int, steps: int, rng: random.Random) -> float:
    """Median step of ``batch`` sequences decoding together around ``context`` tokens."""
    vocab = engine.describe().model.vocab_size
    start = max(context - steps // 2, 2)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request(_prompt(rng, start, vocab), params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # prefill (perhaps over several steps) until every one has its first token
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    for rid in ids:
        engine.retire(rid)
    return statistics.median(times)


def measure_profile(
    engine_dir: Path,
    threads: int,
    run_dtype: DType | Literal["auto"],
    link_bytes_per_s: float,
    prefill_tokens: Sequence[int] = PREFILL_TOKENS,
    batches: Sequence[int] = DECODE_BATCHES,
    contexts: Sequence[int] = DECODE_CONTEXTS,
    repeats: int = 3,
    steps: int = 8,
    device: str = "cpu",
    fast_cpu: bool = True,
) -> HardwareProfile:
    """An engine sized for the grid (one step prefills the longest prompt; the largest batch holds
    the longest context), then every point of it."""
    torch.set_num_threads(threads)
    page = EngineManifest.load(engine_dir).page_size
    longest = max(*prefill_tokens, *contexts)
    cfg = EngineConfig(
        engine_dir=engine_dir,
        device=device,
        num_threads=threads,
        fast_cpu=fast_cpu,
        dtype=run_dtype,
        num_pages=max(batches) * -(-(longest + steps + 4) // page) + 8,
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=longest, max_prefill_chunk=longest),
        prefix_cache=NO_PREFIX_CACHE,  # cost curves of computing, not of reusing
    )
    engine = LLMEngine(cfg, load_tokenizer=False)
    desc = engine.describe()
    dtype = str(desc.dtype).removeprefix("torch.")
    cpu = cpu_info()
    name = f"{cpu.label}, {threads} thread{'s' if threads > 1 else ''}, {dtype}"
    rng = random.Random(0)
    prefill_time(engine, min(prefill_tokens), 1, rng)  # warm-up
    prefill = [(n, prefill_time(engine, n, repeats, rng)) for n in prefill_tokens]
    grid = [[decode_time(engine, b, c, steps, rng) for c in contexts] for b in batches]
    kv_bytes = desc.kv_bytes_per_token
    info = {
        "cpu": cpu.label,
        "flags": " ".join(sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu.flags)),
        "threads": str(torch.get_num_threads()),
        "dtype": dtype,
        "kernel_path": desc.kernel_path,
    }
    return HardwareProfile(
        name=name,
        source=ProfileSource.MEASURED,
        model=desc.source,
        device=info,
        prefill=prefill,
        decode=DecodeGrid(batches=list(batches), contexts=list(contexts), seconds=grid),
        kv_bytes_per_token=kv_bytes,
        link_bytes_per_s=link_bytes_per_s,
    )

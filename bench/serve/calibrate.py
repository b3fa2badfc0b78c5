"""Calibration on this machine (the engine in-process, one thread): the decode step, the prefill time
of candidate prompt lengths (the prefill-heavy length is the one whose prefill takes about
``--prefill-ratio`` decode steps), the copy rate and the KV bytes per token."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from bench.bandwidth import copy_bandwidth
from bench.profile import measure_profile
from planner.profile import HardwareProfile
from torch_engine.config import NO_PREFIX_CACHE, DType, EngineConfig, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams


@dataclass(slots=True)
class Calibration:
    decode_step_s: float
    prefill_s: dict[int, float]
    prefill_len: int
    memcpy_bytes_per_s: float
    kv_bytes_per_token: int
    profile: HardwareProfile | None = None  # the cost curves of one engine process (1 thread): placement, planner


def calibrate(
    engine_dir: Path, lengths: list[int], target_ratio: float, chunk: int, run_dtype: DType | Literal["auto"]
) -> Calibration:
    torch.set_num_threads(1)
    scheduler = SchedulerConfig(max_num_batched_tokens=chunk, max_prefill_chunk=chunk)
    cfg = EngineConfig(
        engine_dir=engine_dir, dtype=run_dtype, num_threads=1, num_pages=512, scheduler=scheduler,
        prefix_cache=NO_PREFIX_CACHE,  # prompt(n) extends prompt(m < n): cached, the curve would be flat
    )  # fmt: skip
    engine = LLMEngine(cfg)
    vocab = engine.describe().model.vocab_size

    def prompt(n: int) -> list[int]:
        return [(i * 7919) % (vocab - 200) + 100 for i in range(n)]

    engine.generate([prompt(64)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    steps = []
    rid = engine.add_request(prompt(64), SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    engine.retire(rid)
    step = statistics.median(steps)
    prefill: dict[int, float] = {}
    for n in lengths:
        times = []
        for _ in range(2):
            rid = engine.add_request(prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - t)
            engine.retire(rid)
        prefill[n] = min(times)
    best = min(lengths, key=lambda n: abs(prefill[n] / step - target_ratio))
    copy = copy_bandwidth(64 << 20, 3)
    # the cost curves of a serving process (1 thread): the placement rule's and the planner's
    # up to the longest calibrated prompt (the default lengths: 16-512 tokens, contexts of 64 and 256)
    longest = max(lengths)
    tokens = sorted({n for n in (16, 32, 64, 128, 256, 512) if n < longest} | {longest})
    contexts = sorted({64, min(256, longest)})
    profile = measure_profile(engine_dir, 1, run_dtype, copy, tokens, (1, 2, 4, 8, 16), contexts, repeats=2, steps=6)
    return Calibration(step, prefill, best, copy, profile.kv_bytes_per_token, profile)

"""``disagg bench overload``: a deployment offered several times what it can serve sheds the rest.

One deployment (``deploy.py``: colocated = two single-core replicas, or one prefill and one decode
process) behind the router, whose admission is bounded (``--max-in-flight`` requests served at
once, ``--max-queued`` waiting at most ``--queue-timeout-s``; beyond: 429 / 503 with Retry-After).
Streamed greedy completions of random vocabulary text (``--prompt-tokens``, ``--max-tokens``), every
prompt distinct (no cache hits). Three phases, in one run:

1. idle: a warm-up, then ``--idle`` requests one at a time: TTFT p50 / p99;
2. capacity: ``max_in_flight`` clients in a closed loop for ``--capacity-s``: completed requests / s;
3. overload: Poisson arrivals at ``--overload`` x that capacity for ``--seconds`` (at most
   ``--max-requests``): each answer (200, 429, 503, other), the TTFT of the admitted, the goodput
   (requests completed / s), the memory of the router and every rank process (RSS) before and
   after, and whether any of them went away (a crash).

The issue's goals (#25): 0 crashes, admitted requests' TTFT p99 within 2x the idle TTFT, memory
within 10 % of the start; also reported: goodput over capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.serve.deploy import MODES, Frontend, Targets, deployment, load_targets
from bench.serve.metrics import pct
from bench.serve.workloads import _text
from builders import BuildOptions, build_engine
from builders.build import DEFAULT_ENGINE_CACHE, default_engine_dir
from orchestrator.client import Completion, complete_via_router
from orchestrator.launch import Launch
from orchestrator.supervisor import run_processes
from torch_engine.config import DType, Role
from torch_engine.cpu import cpu_info
from torch_engine.tokenizer import Tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engine", type=Path, default=None, help="use this (fp32, TP 1) engine directory")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_ENGINE_CACHE)
    p.add_argument("--mode", choices=MODES, default="colocated")
    p.add_argument("--max-in-flight", type=int, default=4, help="the router's requests served at once")
    p.add_argument("--max-queued", type=int, default=4, help="the router's requests waiting for a slot")
    p.add_argument("--queue-timeout-s", type=float, default=0.1, help="the router's longest wait for a slot")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--idle", type=int, default=8, help="idle requests, one at a time")
    p.add_argument("--capacity-s", type=float, default=20.0, help="the closed loop that measures capacity")
    p.add_argument("--overload", type=float, default=3.0, help="offered rate / capacity")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the overload is offered")
    p.add_argument("--max-requests", type=int, default=2000, help="bound on the overload's requests")
    p.add_argument("--chunk", type=int, default=256, help="token budget per step (chunked prefill)")
    p.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/bench_overload"))


@dataclass(slots=True)
class Prompts:
    """Distinct random prompts, made as they are needed."""

    tok: Tokenizer
    length: int
    rng: random.Random

    def next(self) -> str:
        return _text(self.tok, self.rng, self.length)[0]


def status_of(c: Completion) -> int:
    """200 for a completed stream; the HTTP status of a refused one; 0 for any other failure."""
    if c.error is None:
        return 200 if c.times else 0
    head = c.error.split(":", 1)[0]
    return int(head[5:]) if head.startswith("HTTP ") and head[5:].isdigit() else 0


async def _one(to: Targets, prompt: str, max_tokens: int, rid: str) -> Completion:
    return await complete_via_router(to.urls[0], to.model, prompt, max_tokens, rid, True, to.api_key, timeout_s=120.0)


def idle(to: Targets, prompts: Prompts, n: int, max_tokens: int) -> list[float]:
    asyncio.run(_one(to, "Hello there.", 4, "overload-warm"))
    out = []
    for i in range(n):
        c = asyncio.run(_one(to, prompts.next(), max_tokens, f"overload-idle{i}"))
        if c.error is not None or c.ttft is None:
            raise RuntimeError(f"an idle request failed: {c.error}")
        out.append(c.ttft)
    return out


async def closed_loop(
    to: Targets, prompts: Prompts, clients: int, seconds: float, max_tokens: int
) -> tuple[float, list[float]]:
    """``clients`` each sending its next request when one ends: completed requests per second, and
    their TTFTs."""
    end = time.monotonic() + seconds
    ttfts: list[float] = []

    async def client(k: int) -> None:
        i = 0
        while time.monotonic() < end:
            c = await _one(to, prompts.next(), max_tokens, f"overload-cap{k}-{i}")
            if status_of(c) == 200 and c.ttft is not None:
                ttfts.append(c.ttft)
            i += 1

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return len(ttfts) / (time.monotonic() - t0), ttfts


async def open_loop(
    to: Targets, prompts: list[str], rate: float, seconds: float, max_tokens: int, seed: int
) -> tuple[list[Completion], float]:
    """Poisson arrivals at ``rate`` for ``seconds`` (one prompt each, at most ``len(prompts)``); the
    answers and the wall time until the last one."""
    rng = random.Random(f"overload-arrivals-{seed}")
    arrivals: list[float] = []
    t = 0.0
    while t < seconds and len(arrivals) < len(prompts):
        arrivals.append(t)
        t += rng.expovariate(rate)
    start = time.monotonic()

    async def one(i: int) -> Completion:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - start)))
        return await _one(to, prompts[i], max_tokens, f"overload-{i}")

    answers = await asyncio.gather(*(one(i) for i in range(len(arrivals))))
    return list(answers), time.monotonic() - start


def processes(launch: Launch) -> set[int]:
    pids = set(run_processes(launch.run_id))
    if launch.router is not None and launch.router.proc is not None:
        pids.add(launch.router.proc.pid)
    return pids


def rss_mib(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total / 1024


@dataclass(slots=True)
class Report:
    idle_ttft_p50: float
    idle_ttft_p99: float
    capacity_req_s: float
    capacity_ttft_p50: float | None  # the closed loop's: what max_in_flight requests at once cost
    capacity_ttft_p99: float | None
    offered_req_s: float
    requests: int
    answers: dict[str, int] = field(default_factory=dict)  # status -> count
    admitted_ttft_p50: float | None = None
    admitted_ttft_p99: float | None = None
    goodput_req_s: float = 0.0
    wall_s: float = 0.0
    memory_start_mib: float = 0.0
    memory_end_mib: float = 0.0
    crashed: list[int] = field(default_factory=list)  # pids of the start that are gone
    goals: dict[str, float | bool | None] = field(default_factory=dict)


def measure(a: argparse.Namespace, launch: Launch, tok: Tokenizer) -> Report:
    to = load_targets(launch, Frontend.ROUTER)
    prompts = Prompts(tok, a.prompt_tokens, random.Random(f"overload-{a.seed}"))
    ttfts = idle(to, prompts, a.idle, a.max_tokens)
    p50, p99 = statistics.median(ttfts), pct(ttfts, 99) or 0.0
    print(f"[bench] idle TTFT p50 {1000 * p50:.0f} ms, p99 {1000 * p99:.0f} ms", flush=True)
    capacity, at_capacity = asyncio.run(closed_loop(to, prompts, a.max_in_flight, a.capacity_s, a.max_tokens))
    rate = a.overload * capacity
    print(f"[bench] capacity {capacity:.2f} req/s ({a.max_in_flight} clients, TTFT p50 "
          f"{1000 * (pct(at_capacity, 50) or 0):.0f} ms, p99 {1000 * (pct(at_capacity, 99) or 0):.0f} ms); offering "
          f"{rate:.2f} req/s for {a.seconds:.0f} s", flush=True)  # fmt: skip
    texts = [prompts.next() for _ in range(min(a.max_requests, int(rate * a.seconds * 1.5) + 10))]
    time.sleep(2.0)  # the closed loop's last streams end
    before = processes(launch)
    mem0 = rss_mib(before)
    answers, wall = asyncio.run(open_loop(to, texts, rate, a.seconds, a.max_tokens, a.seed))
    time.sleep(3.0)  # settle: whatever the overload left behind is freed or is a leak
    after = processes(launch)
    cap50, cap99 = pct(at_capacity, 50), pct(at_capacity, 99)
    r = Report(p50, p99, capacity, cap50, cap99, rate, len(answers), wall_s=wall, memory_start_mib=mem0)
    r.memory_end_mib = rss_mib(after)
    r.crashed = sorted(before - after)
    for c in answers:
        key = str(status_of(c))
        r.answers[key] = r.answers.get(key, 0) + 1
    admitted = [c.ttft for c in answers if status_of(c) == 200 and c.ttft is not None]
    r.admitted_ttft_p50, r.admitted_ttft_p99 = pct(admitted, 50), pct(admitted, 99)
    r.goodput_req_s = len(admitted) / wall if wall else 0.0
    r.goals = {
        "crashes": len(r.crashed),
        "admitted_ttft_p99_over_idle_p50": r.admitted_ttft_p99 / p50 if r.admitted_ttft_p99 else None,
        "memory_end_over_start": r.memory_end_mib / mem0 if mem0 else None,
        "goodput_over_capacity": r.goodput_req_s / capacity if capacity else None,
        "other_answers": sum(n for s, n in r.answers.items() if s not in ("200", "429", "503")),
    }
    return r


def run(a: argparse.Namespace) -> int:
    opts = BuildOptions(role=Role.COLOCATED, tp_size=1, dtype=DType.FLOAT32, page_size=16)
    engine_dir = a.engine or build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    admission = {"max_in_flight": a.max_in_flight, "max_queued": a.max_queued, "queue_timeout_s": a.queue_timeout_s}
    cfg = deployment(a.mode, engine_dir, out, a.chunk, a.cores, 8, frontend=Frontend.ROUTER, router=admission)
    launch = Launch(cfg)
    try:
        launch.prepare(progress=False)
        launch.start()
        launch.wait_ready()
        report = measure(a, launch, Tokenizer(engine_dir))
    finally:
        launch.stop()
    result = {
        "command": "disagg " + " ".join(a.argv),
        "machine": {**cpu_info().as_dict(), "cores": os.cpu_count()},
        "mode": a.mode,
        "admission": admission,
        "report": asdict(report),
    }
    (out / "bench_overload.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(json.dumps(asdict(report), indent=2))
    print(f"[bench] wrote {out / 'bench_overload.json'}", flush=True)
    return 0

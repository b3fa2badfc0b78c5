"""``disagg bench prefix``: the prefix cache off and on, colocated and disaggregated, in one run.

Workloads (seeded; random vocabulary text, greedy, every request asks for exactly its
``max_tokens``), both through the router's OpenAI API (its cache-aware routing included):

- ``multi-turn``: conversations of 4-8 turns over one shared system prompt of 1-2k tokens; each
  turn resends the history (system prompt, earlier questions and answers) plus a new question of
  16-48 tokens, asks for 24-48 tokens, and the next turn follows a think time (exponential, mean
  ``--think-s``). Conversations start at seeded Poisson times.
- ``shared-prefix``: a few system prompts (``--system-prompts``) of 1-2k tokens and many users,
  each sending one question of 16-48 tokens after one of them, at a rate above what the
  deployment serves with the cache off (its idle cold TTFT gives the estimate), so throughput
  and goodput show what the cache saves.

Per cache setting the two deployments (``deploy.py``: two colocated replicas vs one prefill and
one decode process, a core each) run side by side; the cache-off pair first, then the cache-on
pair, same requests, same schedule. Greedy outputs are the same either way, so a turn's prompt is
the same text with the cache on and off and its figures pair up. Per point: TTFT p50 / p99 (all,
and of turns >= 3), ITL p99, output throughput, goodput (requests inside the SLO per second:
TTFT <= ``--slo-ttft`` x the idle cold TTFT, TPOT <= ``--slo-tpot`` x the idle decode step),
the hit rate per side (the decoder's and the prefill node's cached tokens, from the node traces),
KV bytes per request (the prefill nodes' traces), and whether every response's
``usage.prompt_tokens_details.cached_tokens`` equals the tokens its decode node skipped.
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
from planner.placement import PlacementSpec, PrefillPlacement
from serving.trace import read_trace
from torch_engine.config import DType, Role
from torch_engine.cpu import cpu_info
from torch_engine.tokenizer import Tokenizer

WORKLOADS = ("multi-turn", "shared-prefix")
CACHE = ("off", "on")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engine", type=Path, default=None, help="use this (fp32, TP 1) engine directory")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_ENGINE_CACHE)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--conversation-rate", type=float, default=0.5, help="conversations started per second")
    p.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns")
    p.add_argument("--users", type=int, default=24, help="shared-prefix: requests")
    p.add_argument("--system-prompts", type=int, default=3, help="shared-prefix: distinct system prompts")
    p.add_argument("--overload", type=float, default=1.5, help="shared-prefix: rate / the cache-off capacity estimate")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: TTFT <= this x the idle cold TTFT")
    p.add_argument("--slo-tpot", type=float, default=2.0, help="SLO: time per output token <= this x the idle step")
    p.add_argument("--chunk", type=int, default=256, help="token budget per step (chunked prefill)")
    p.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    p.add_argument("--run-dtype", choices=["auto", *(d.value for d in DType)], default="auto")
    p.add_argument("--max-seconds", type=float, default=300.0, help="bound on one point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/bench_prefix"))


# -- workloads --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Turn:
    question: str
    max_tokens: int
    think_s: float


@dataclass(frozen=True, slots=True)
class Conversation:
    start_s: float
    system: str
    turns: tuple[Turn, ...]


def conversations(tok: Tokenizer, n: int, rate: float, think_s: float, seed: int) -> list[Conversation]:
    rng = random.Random(f"multi-turn-{seed}")
    system, _ = _text(tok, rng, rng.randint(1024, 2048))
    out, t = [], 0.0
    for _ in range(n):
        turns = tuple(
            Turn(_text(tok, rng, rng.randint(16, 48))[0], rng.randint(24, 48), rng.expovariate(1 / think_s))
            for _ in range(rng.randint(4, 8))
        )
        out.append(Conversation(t, system, turns))
        t += rng.expovariate(rate)
    return out


def shared_prefix(tok: Tokenizer, users: int, prompts: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(f"shared-prefix-{seed}")
    systems = [_text(tok, rng, rng.randint(1024, 2048))[0] for _ in range(prompts)]
    return [(rng.choice(systems) + _text(tok, rng, rng.randint(16, 48))[0], rng.randint(24, 48)) for _ in range(users)]


# -- running ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Sample:
    request_id: str
    turn: int  # multi-turn: the turn's index; shared-prefix: 0
    max_tokens: int
    done: Completion

    @property
    def ok(self) -> bool:
        return self.done.error is None and self.done.ttft is not None


async def _send(to: Targets, prompt: str, max_tokens: int, rid: str) -> Completion:
    return await complete_via_router(to.urls[0], to.model, prompt, max_tokens, rid, True, to.api_key)


async def run_conversations(to: Targets, convs: list[Conversation], tag: str, bound: float) -> list[Sample]:
    samples: list[Sample] = []
    start = time.monotonic()

    async def one(ci: int, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, conv.start_s - (time.monotonic() - start)))
        history = conv.system
        for t, turn in enumerate(conv.turns):
            prompt = history + turn.question
            c = await _send(to, prompt, turn.max_tokens, f"{tag}-c{ci}t{t}")
            samples.append(Sample(c.request_id, t, turn.max_tokens, c))
            if c.error is not None:
                return
            history = prompt + c.text
            await asyncio.sleep(turn.think_s)

    tasks = [asyncio.create_task(one(i, c)) for i, c in enumerate(convs)]
    _, pending = await asyncio.wait(tasks, timeout=bound)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return samples


async def run_shared(to: Targets, reqs: list[tuple[str, int]], rate: float, tag: str, bound: float) -> list[Sample]:
    rng = random.Random(f"shared-arrivals-{rate:.6f}")
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(rate)
    start = time.monotonic()

    async def one(i: int, prompt: str, max_tokens: int) -> Sample:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - start)))
        return Sample(f"{tag}-u{i}", 0, max_tokens, await _send(to, prompt, max_tokens, f"{tag}-u{i}"))

    tasks = [asyncio.create_task(one(i, p, m)) for i, (p, m) in enumerate(reqs)]
    done, pending = await asyncio.wait(tasks, timeout=bound)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() for task in tasks if task in done and task.exception() is None]


# -- figures ----------------------------------------------------------------------------------
@dataclass(slots=True)
class NodeView:
    """Per client request id, from the node traces: the decoder's and the prefill node's cached
    tokens and the KV bytes a prefill node wrote."""

    decoder_cached: dict[str, int] = field(default_factory=dict)
    prefill_cached: dict[str, int] = field(default_factory=dict)
    kv_bytes: dict[str, int] = field(default_factory=dict)


def _int(v: object) -> int:
    return int(v) if isinstance(v, int | float | str) else 0


def node_view(run_dir: Path, tag: str) -> NodeView:
    view = NodeView()
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        for rec in read_trace(path):
            client = str(rec["request_id"]).split("#", 1)[0]
            if not client.startswith(tag + "-"):
                continue
            if path.name.startswith("prefill"):
                view.prefill_cached[client] = _int(rec.get("prefill_cached_tokens"))
                view.kv_bytes[client] = view.kv_bytes.get(client, 0) + _int(rec.get("kv_bytes"))
            elif "cached_tokens" in rec:
                view.decoder_cached[client] = _int(rec["cached_tokens"])
    return view


@dataclass(slots=True)
class Point:
    workload: str
    mode: str
    cache: str
    requests: int
    errors: int
    wall_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_late_p50: float | None  # multi-turn: turns >= 3
    ttft_late_p99: float | None
    itl_p99: float | None
    throughput_tok_s: float
    goodput_req_s: float
    prompt_tokens: int
    decoder_hit_rate: float
    prefill_hit_rate: float
    kv_bytes_mean: float
    cached_tokens_exact: bool  # usage.cached_tokens == the decode node's own count, on every request
    kv_bytes: dict[str, int] = field(default_factory=dict)  # request id -> bytes (pairs on / off up)


def summarize(
    workload: str, mode: str, cache: str, samples: list[Sample], wall: float, view: NodeView, slo: tuple[float, float]
) -> Point:
    ok = [s for s in samples if s.ok]
    ttfts = [s.done.ttft for s in ok if s.done.ttft is not None]
    late = [s.done.ttft for s in ok if s.turn >= 2 and s.done.ttft is not None]
    itls = [x for s in ok for x in s.done.itls]
    tokens = sum(len(s.done.times) for s in ok)

    def good(s: Sample) -> bool:
        tpot = statistics.mean(s.done.itls) if s.done.itls else 0.0
        return s.done.ttft is not None and s.done.ttft <= slo[0] and tpot <= slo[1]

    prompt = sum(s.done.prompt_tokens or 0 for s in ok)
    decoder = sum(view.decoder_cached.get(s.request_id, 0) for s in ok)
    prefill = sum(view.prefill_cached.get(s.request_id, 0) for s in ok)
    exact = all(s.done.cached_tokens == view.decoder_cached.get(s.request_id) for s in ok)
    moved = {s.request_id: view.kv_bytes.get(s.request_id, 0) for s in ok}
    return Point(
        workload, mode, cache, len(samples), len(samples) - len(ok), wall, pct(ttfts, 50), pct(ttfts, 99),
        pct(late, 50), pct(late, 99), pct(itls, 99), tokens / wall if wall else 0.0,
        sum(1 for s in ok if good(s)) / wall if wall else 0.0, prompt, decoder / prompt if prompt else 0.0,
        prefill / prompt if prompt else 0.0, statistics.mean(moved.values()) if moved else 0.0, exact, moved,
    )  # fmt: skip


def ratios(points: list[Point]) -> dict[str, float | None]:
    """The issue's goals as measured ratios (cache on over off, same mode and workload)."""
    by = {(p.workload, p.mode, p.cache): p for p in points}
    out: dict[str, float | None] = {}
    for mode in MODES:
        off, on = by.get(("multi-turn", mode, "off")), by.get(("multi-turn", mode, "on"))
        if off and on and off.ttft_late_p50 and on.ttft_late_p50:
            out[f"multi_turn_late_ttft_p50_off_over_on_{mode}"] = off.ttft_late_p50 / on.ttft_late_p50
        if off and on and off.itl_p99 and on.itl_p99:
            out[f"multi_turn_itl_p99_on_over_off_{mode}"] = on.itl_p99 / off.itl_p99
        if mode == "disaggregated" and off and on:
            warm = _warm_ratios(off, on)
            out["multi_turn_warm_kv_bytes_on_over_off_max"] = max(warm) if warm else None
        soff, son = by.get(("shared-prefix", mode, "off")), by.get(("shared-prefix", mode, "on"))
        if soff and son and soff.throughput_tok_s:
            out[f"shared_prefix_throughput_on_over_off_{mode}"] = son.throughput_tok_s / soff.throughput_tok_s
        if soff and son and soff.goodput_req_s:
            out[f"shared_prefix_goodput_on_over_off_{mode}"] = son.goodput_req_s / soff.goodput_req_s
    return out


def _warm_ratios(off: Point, on: Point) -> list[float]:
    """KV bytes of each warm turn (turn >= 1) with the cache on over the same turn with it off."""
    cold = {r.rsplit("-", 1)[-1]: b for r, b in off.kv_bytes.items()}
    out = []
    for r, b in on.kv_bytes.items():
        key = r.rsplit("-", 1)[-1]  # "c{i}t{t}"
        if not key.endswith("t0") and cold.get(key):
            out.append(b / cold[key])
    return out


# -- the run ----------------------------------------------------------------------------------
def _idle(to: Targets, prompt: str, tag: str) -> tuple[float, float]:
    """A warm-up, then one cold request alone: (TTFT, median decode step)."""
    asyncio.run(_send(to, "Hello there.", 4, f"{tag}-warm"))
    c = asyncio.run(_send(to, prompt, 32, f"{tag}-cold"))
    if c.error is not None or c.ttft is None:
        raise RuntimeError(f"the idle request failed: {c.error}")
    return c.ttft, statistics.median(c.itls)


@dataclass(slots=True)
class _Run:
    """What the cache-off pair measures first and the cache-on pair reuses: the SLO and the rate."""

    slo: tuple[float, float] | None = None
    rate: float = 0.0
    points: list[Point] = field(default_factory=list)


def _pair(a: argparse.Namespace, engine_dir: Path, out: Path, cache: str) -> dict[str, Launch]:
    placement = PlacementSpec(mode=PrefillPlacement.REMOTE)
    return {
        m: Launch(
            deployment(m, engine_dir, out / cache, a.chunk, a.cores, 8, a.run_dtype, Frontend.ROUTER, placement,
                       prefix_cache=cache == "on")
        )
        for m in MODES
    }  # fmt: skip


def _setting(
    a: argparse.Namespace, run: _Run, launches: dict[str, Launch], cache: str,
    work: tuple[list[Conversation], list[tuple[str, int]]],
) -> None:  # fmt: skip
    """One cache setting: both deployments up, the idle request (the SLO, from the first setting), the workloads."""
    convs, shared = work
    for launch in launches.values():
        launch.prepare(progress=False)
        launch.start()
    for launch in launches.values():
        launch.wait_ready()
    to = {m: load_targets(launches[m], Frontend.ROUTER) for m in MODES}
    idle = {m: _idle(to[m], shared[0][0], f"idle-{cache}-{m}") for m in MODES}
    if run.slo is None:
        ttft, step = idle["colocated"]
        run.slo = (a.slo_ttft * ttft, a.slo_tpot * step)
        run.rate = a.overload * 2 / (ttft + statistics.mean(m for _, m in shared) * step)  # two replicas
        print(f"[bench] idle cold TTFT {ttft:.2f} s, step {1000 * step:.0f} ms; SLO TTFT <= {run.slo[0]:.2f} s, "
              f"TPOT <= {1000 * run.slo[1]:.0f} ms; shared-prefix at {run.rate:.2f} req/s", flush=True)  # fmt: skip
    for wl in a.workloads:
        for m in MODES:
            tag = f"{wl}-{m}-{cache}"
            t0 = time.monotonic()
            if wl == "multi-turn":
                samples = asyncio.run(run_conversations(to[m], convs, tag, a.max_seconds))
            else:
                samples = asyncio.run(run_shared(to[m], shared, run.rate, tag, a.max_seconds))
            wall = time.monotonic() - t0
            time.sleep(1.0)  # the last trace lines land
            p = summarize(wl, m, cache, samples, wall, node_view(launches[m].run_dir, tag), run.slo)
            run.points.append(p)
            print(line(p), flush=True)


def run(a: argparse.Namespace) -> int:
    opts = BuildOptions(role=Role.COLOCATED, tp_size=1, dtype=DType.FLOAT32, page_size=16)
    engine_dir = a.engine or build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(engine_dir)
    work = (
        conversations(tok, a.conversations, a.conversation_rate, a.think_s, a.seed),
        shared_prefix(tok, a.users, a.system_prompts, a.seed),
    )
    state = _Run()
    for cache in CACHE:  # off first: its idle figures set the SLO and the shared-prefix rate
        launches = _pair(a, engine_dir, out, cache)
        try:
            _setting(a, state, launches, cache, work)
        finally:
            for launch in launches.values():
                launch.stop()
    goals = ratios(state.points)
    report = {
        "command": "disagg " + " ".join(a.argv),
        "machine": {**cpu_info().as_dict(), "cores": os.cpu_count()},
        "slo": {"ttft_s": state.slo[0], "tpot_s": state.slo[1]} if state.slo else None,
        "shared_prefix_rate": state.rate,
        "points": [{k: v for k, v in asdict(p).items() if k != "kv_bytes"} for p in state.points],
        "ratios": goals,
    }
    (out / "bench_prefix.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(json.dumps(goals, indent=2))
    print(f"[bench] wrote {out / 'bench_prefix.json'}", flush=True)
    return 0


def line(p: Point) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    return (
        f"[bench] {p.workload:13s} {p.mode:13s} cache {p.cache:3s}  TTFT p50/p99 {ms(p.ttft_p50)}/{ms(p.ttft_p99)} ms"
        f"  turns>=3 {ms(p.ttft_late_p50)}/{ms(p.ttft_late_p99)} ms  ITL p99 {ms(p.itl_p99)} ms"
        f"  {p.throughput_tok_s:.1f} tok/s  goodput {p.goodput_req_s:.2f} req/s  hits decoder "
        f"{100 * p.decoder_hit_rate:.0f}% prefill {100 * p.prefill_hit_rate:.0f}%  KV {p.kv_bytes_mean / 2**20:.2f} "
        f"MiB/req  cached_tokens exact {p.cached_tokens_exact}  errors {p.errors}/{p.requests}"
    )

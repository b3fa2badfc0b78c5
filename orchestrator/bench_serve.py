"""``disagg bench serve``: colocated vs disaggregated on equal hardware, one invocation (DESIGN section 6).

1. Calibrate on this machine (the engine in-process, one thread): the decode step, the prefill
   time of candidate prompt lengths (the prefill-heavy length is the one whose prefill takes
   about ``--prefill-ratio`` decode steps), the memcpy rate and the KV bytes per token.
2. Launch both deployments through the launcher, side by side: colocated = two single-core
   replicas (``taskset``, chunked prefill on, clients round-robin); disaggregated = one prefill
   and one decode process, one core each. One torch thread per process in both.
3. Per workload: idle measurements (one request at a time) give the SLOs: TTFT <= 3 x idle
   TTFT (the idle prefill), TPOT <= 1.5 x idle decode step. They double as the warm-up.
4. A request-rate sweep (seeded Poisson arrivals, the same requests and schedule for both
   modes; the mode that goes first alternates per rate), each point bounded in time.
5. Per point: TTFT / ITL / TPOT p50 / p90 / p99, the longest stall, throughput, SLO attainment,
   and the TTFT split (queue / prefill / transfer / handover) from the nodes' traces. Goodput =
   the highest rate with >= 90 % of requests inside both SLOs. JSON, CSV and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import tritonclient.grpc.aio as aioclient
from tqdm import tqdm

from builders import BuildOptions, build_engine
from builders.build import default_engine_dir
from kv_messenger.trace import read_trace
from orchestrator.bench_engine import memcpy_bandwidth
from orchestrator.bench_workload import BenchRequest, Workload, make_requests, poisson_arrivals, save_requests
from orchestrator.client import Completion, generate
from orchestrator.cluster import ClusterConfig
from orchestrator.launch import Launch
from orchestrator.triton import free_port
from torch_engine.config import DType, EngineConfig, Role
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

MODES = ("colocated", "disaggregated")
ATTAINMENT = 0.9


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


# -- 1. calibration ------------------------------------------------------------------------
@dataclass(slots=True)
class Calibration:
    decode_step_s: float
    prefill_s: dict[int, float]
    prefill_len: int
    memcpy_bytes_per_s: float
    kv_bytes_per_token: int


def calibrate(engine_dir: Path, lengths: list[int], target_ratio: float, chunk: int) -> Calibration:
    torch.set_num_threads(1)
    engine = LLMEngine(
        EngineConfig(engine_dir=engine_dir, num_threads=1, num_pages=512, max_num_batched_tokens=chunk,
                     max_prefill_chunk=chunk)
    )  # fmt: skip
    vocab = engine.manifest.model.vocab_size

    def prompt(n: int) -> list[int]:
        return [(i * 7919) % (vocab - 200) + 100 for i in range(n)]

    engine.generate([prompt(64)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    steps = []
    engine.add_request(prompt(64), SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    engine.requests.clear()
    step = statistics.median(steps)
    prefill: dict[int, float] = {}
    for n in lengths:
        times = []
        for _ in range(2):
            engine.add_request(prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - t)
            engine.requests.clear()
        prefill[n] = min(times)
    best = min(lengths, key=lambda n: abs(prefill[n] / step - target_ratio))
    kv = sum(p[0].numel() * p.element_size() for p in engine.kv.pools) // engine.kv.spec.page_size
    return Calibration(step, prefill, best, memcpy_bandwidth(64 << 20, 3), kv)


# -- 2. deployments ------------------------------------------------------------------------
def deployment(
    mode: str, engine_dir: Path, out: Path, chunk: int, cores: list[int], layers_per_post: int = 1
) -> ClusterConfig:
    base: dict[str, object] = {
        "mode": mode,
        "dtype": "float32",
        "threads_per_rank": 1,
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": chunk, "max_prefill_chunk": chunk},
        "ports": {"http": free_port(), "grpc": free_port(), "metrics": free_port()},
        "run_dir": str(out / mode),
        "timeouts": {"startup_s": 300, "kv_transfer_s": 120},
        "transport": {"layers_per_post": layers_per_post},
    }
    group = {"tp": 1, "engine_dir": str(engine_dir), "num_pages": 2048}
    if mode == "colocated":
        base |= {"prefill": {"count": 0}, "decode": group | {"count": 2, "cores": cores[:2]}}
    else:
        base |= {
            "prefill": group | {"count": 1, "cores": cores[:1]},
            "decode": group | {"count": 1, "cores": cores[1:2]},
        }
    return ClusterConfig.parse(base, f"bench {mode} deployment")


def decode_urls(launch: Launch) -> list[str]:
    assert launch.prepared is not None
    return [f"{launch.cfg.bind}:{ld.ports.grpc}" for ld in launch.prepared.leaders if ld.slot.role is not Role.PREFILL]


# -- 3-4. load -----------------------------------------------------------------------------
async def replay(
    urls: list[str],
    requests: list[BenchRequest],
    arrivals: list[float],
    tag: str,
    max_seconds: float,
    bar: tqdm | None = None,
) -> tuple[list[Completion], float]:
    """Send each request at its arrival time (round-robin over ``urls``); returns them and the wall time."""
    clients = [aioclient.InferenceServerClient(u) for u in urls]
    start = time.monotonic()

    async def one(i: int, req: BenchRequest) -> Completion:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - start)))
        done = await generate(clients[i % len(clients)], req.prompt, req.max_tokens, f"{tag}-{i}", ignore_eos=True)
        if bar is not None:
            bar.update(1)
        return done

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
    finished, pending = await asyncio.wait(tasks, timeout=max_seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - start
    for c in clients:
        await c.close()
    out = []
    for i, t in enumerate(tasks):
        if t in finished and t.exception() is None:
            out.append(t.result())
        else:
            c = Completion(f"{tag}-{i}", 0.0)
            c.error = f"not finished within the {max_seconds:.0f} s bound"
            out.append(c)
    return out, wall


# -- 5. metrics ----------------------------------------------------------------------------
@dataclass(slots=True)
class Split:
    queue: float
    prefill: float
    transfer: float
    handover: float


def ttft_splits(run_dir: Path, tag: str) -> dict[str, Split]:
    """Server-side TTFT split per client request id (``tag-i``), from the node traces."""
    decode: dict[str, dict] = {}
    prefill: dict[str, dict] = {}
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        for rec in read_trace(path):
            rid = str(rec["request_id"])
            if not rid.startswith(tag + "-"):
                continue
            (prefill if path.name.startswith("prefill") else decode)[rid] = rec
    out: dict[str, Split] = {}
    for rid, d in decode.items():
        client = rid.split("#", 1)[0]
        if "first_token" not in d or "scheduled" not in d:
            continue
        p = prefill.get(rid)
        if p is None:  # colocated: it prefills itself; the first token comes out of the last chunk
            out[client] = Split(d["scheduled"] - d["arrived"], d["first_token"] - d["scheduled"], 0.0, 0.0)
        elif "prefilled" in p and "kv_ready" in d and "scheduled" in p:
            landed = max(d["kv_ready"], p["prefilled"])
            out[client] = Split(
                p["scheduled"] - d["arrived"],
                p["prefilled"] - p["scheduled"],
                landed - p["prefilled"],
                d["first_token"] - landed,
            )
    return out


@dataclass(slots=True)
class PointSummary:
    mode: str
    workload: str
    rate: float
    requests: int
    errors: int
    wall_s: float
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    tpot_p99: float | None
    max_stall: float | None
    throughput_tok_s: float
    slo_attainment: float
    split_queue: float | None
    split_prefill: float | None
    split_transfer: float | None
    split_handover: float | None
    itls: list[float] = field(default_factory=list)


def summarize(
    mode: str, workload: Workload, rate: float, done: list[Completion], wall: float, slo: tuple[float, float],
    splits: dict[str, Split],
) -> PointSummary:  # fmt: skip
    ttft_slo, tpot_slo = slo
    ttfts, itls, tpots, ok, tokens = [], [], [], 0, 0
    for c in done:
        if c.error is not None or c.ttft is None:
            continue
        ttfts.append(c.ttft)
        itls += c.itls
        tokens += len(c.times)
        tpot = (c.times[-1] - c.times[0]) / (len(c.times) - 1) if len(c.times) > 1 else 0.0
        tpots.append(tpot)
        ok += c.ttft <= ttft_slo and tpot <= tpot_slo
    sp = list(splits.values())

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return PointSummary(
        mode, workload.value, rate, len(done), sum(c.error is not None for c in done), wall,
        pct(ttfts, 50), pct(ttfts, 90), pct(ttfts, 99), pct(itls, 50), pct(itls, 90), pct(itls, 99),
        pct(tpots, 50), pct(tpots, 90), pct(tpots, 99), max(itls) if itls else None,
        tokens / wall if wall > 0 else 0.0, ok / len(done) if done else 0.0,
        med([s.queue for s in sp]), med([s.prefill for s in sp]), med([s.transfer for s in sp]),
        med([s.handover for s in sp]), itls,
    )  # fmt: skip


def goodput(points: list[PointSummary], mode: str, workload: str) -> float:
    ok = [p.rate for p in points if p.mode == mode and p.workload == workload and p.slo_attainment >= ATTAINMENT]
    return max(ok, default=0.0)


# -- the command ---------------------------------------------------------------------------
def run_serve_bench(a: argparse.Namespace) -> int:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    opts = BuildOptions(role=Role.COLOCATED, tp_size=1, dtype=DType.FLOAT32, page_size=16)
    engine_dir = a.engine or build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts)
    print(f"[bench] calibrating on {engine_dir.name} (1 thread)", flush=True)
    cal = calibrate(engine_dir, a.calibrate_lengths, a.prefill_ratio, a.chunk)
    print(
        f"[bench] decode step {1000 * cal.decode_step_s:.1f} ms; prefill-heavy prompt {cal.prefill_len} tokens "
        f"({cal.prefill_s[cal.prefill_len] / cal.decode_step_s:.1f} steps)",
        flush=True,
    )
    from torch_engine.tokenizer import Tokenizer

    tok = Tokenizer(engine_dir)
    workloads = [Workload(w) for w in a.workloads]
    launches = {m: Launch(deployment(m, engine_dir, out, a.chunk, a.cores, a.layers_per_post)) for m in MODES}
    report: dict[str, object] = {
        "command": "disagg bench serve " + " ".join(a.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "calibration": asdict(cal),
        "workloads": {},
    }
    points: list[PointSummary] = []
    try:
        for launch in launches.values():
            launch.prepare(progress=False)
            launch.start()
        for m, launch in launches.items():
            launch.wait_ready()
            print(f"[bench] {m} deployment ready: {', '.join(decode_urls(launch))}", flush=True)
        for wl in workloads:
            reqs = make_requests(tok, wl, a.requests, cal.prefill_len, a.seed)
            save_requests(out / f"requests-{wl.value}.jsonl", reqs)
            idle = {m: measure_idle(launches[m], reqs[: a.idle_requests], f"idle-{wl.value}-{m}") for m in MODES}
            ttft_idle = idle["colocated"]["ttft"]
            step_idle = idle["colocated"]["itl"]
            slo = (3 * ttft_idle, 1.5 * step_idle)
            mean_out = statistics.mean(r.max_tokens for r in reqs)
            sat = 2 / (ttft_idle + 0.25 * mean_out * step_idle)  # two replicas; decode amortised over ~4 streams
            rates = a.rates or [round(m * sat, 3) for m in a.rate_multiples]
            print(
                f"[bench] {wl.value}: SLO TTFT <= {slo[0]:.2f} s, TPOT <= {1000 * slo[1]:.0f} ms; "
                f"rates {rates} req/s (saturation estimate {sat:.2f})",
                flush=True,
            )
            wl_points = []
            for ri, rate in enumerate(rates):
                arrivals = poisson_arrivals(len(reqs), rate, a.seed)
                order = MODES if ri % 2 == 0 else MODES[::-1]
                for m in order:
                    tag = f"{wl.value}-{m}-r{ri}"
                    bar = tqdm(total=len(reqs), desc=f"{wl.value} {m} {rate:.2f}/s", leave=False)
                    launch = launches[m]
                    done, wall = asyncio.run(replay(decode_urls(launch), reqs, arrivals, tag, a.max_seconds, bar))
                    bar.close()
                    time.sleep(0.5)  # let the last trace lines land
                    splits = ttft_splits(launch.run_dir, tag)
                    p = summarize(m, wl, rate, done, wall, slo, splits)
                    wl_points.append(p)
                    print(_line(p), flush=True)
            points += wl_points
            report["workloads"][wl.value] = {  # type: ignore[index]
                "requests": len(reqs),
                "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in reqs),
                "output_tokens_mean": mean_out,
                "idle": idle,
                "slo": {"ttft_s": slo[0], "tpot_s": slo[1]},
                "rates": rates,
                "goodput": {m: goodput(wl_points, m, wl.value) for m in MODES},
            }
    finally:
        for launch in launches.values():
            launch.stop()
    report["points"] = [{k: v for k, v in asdict(p).items() if k != "itls"} for p in points]
    report["targets"] = targets(report, points, cal)
    write_outputs(out, a.json, report, points)
    print(json.dumps(report["targets"], indent=2))
    return 0


def measure_idle(launch: Launch, reqs: list[BenchRequest], tag: str) -> dict[str, float]:
    """One request at a time: the first warms up, the rest give the idle TTFT and decode step."""
    urls = decode_urls(launch)[:1]
    ttfts, itls = [], []
    for i, r in enumerate(reqs):
        done, _ = asyncio.run(replay(urls, [r], [0.0], f"{tag}{i}", 300))
        c = done[0]
        if c.error is not None or c.ttft is None:
            raise RuntimeError(f"idle request failed on {launch.cfg.mode.value}: {c.error}")
        if i:
            ttfts.append(c.ttft)
            itls += c.itls
    return {"ttft": statistics.median(ttfts), "itl": statistics.median(itls)}


def targets(report: dict, points: list[PointSummary], cal: Calibration) -> dict[str, object]:
    """The issue's targets, each with its measured ratio and whether it is met."""
    out: dict[str, object] = {}
    wls = report["workloads"]
    ph = wls.get(Workload.PREFILL_HEAVY.value)
    if ph is not None:
        g = ph["goodput"]
        ratio = g["disaggregated"] / g["colocated"] if g["colocated"] else None
        out["goodput_ratio_prefill_heavy"] = {"value": ratio, "target": 1.5, "met": ratio is not None and ratio >= 1.5}
        at = g["disaggregated"] or min(ph["rates"])
        by = {p.mode: p for p in points if p.workload == Workload.PREFILL_HEAVY.value and p.rate == at}
        itl = (by["colocated"].itl_p99 or 0) / (by["disaggregated"].itl_p99 or 1) if len(by) == 2 else None
        met = itl is not None and itl >= 1.8
        out["p99_itl_ratio_prefill_heavy"] = {"rate": at, "value": itl, "target": 1.8, "met": met}
        added = ph["idle"]["disaggregated"]["ttft"] - ph["idle"]["colocated"]["ttft"]
        floor = ph["prompt_tokens_mean"] * cal.kv_bytes_per_token
        budget = floor / cal.memcpy_bytes_per_s + 2 * ph["idle"]["colocated"]["itl"]
        out["added_ttft_prefill_heavy"] = {"value_s": added, "budget_s": budget, "met": added <= budget}
    dh = wls.get(Workload.DECODE_HEAVY.value)
    if dh is not None:
        g = dh["goodput"]
        ratio = g["disaggregated"] / g["colocated"] if g["colocated"] else None
        out["goodput_ratio_decode_heavy"] = {"value": ratio, "target": 0.95, "met": ratio is not None and ratio >= 0.95}
    return out


def _line(p: PointSummary) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    return (
        f"[bench] {p.workload:13s} {p.mode:13s} {p.rate:6.3f}/s  SLO {100 * p.slo_attainment:5.1f}%  "
        f"TTFT p50/p99 {ms(p.ttft_p50)}/{ms(p.ttft_p99)} ms  ITL p50/p99 {ms(p.itl_p50)}/{ms(p.itl_p99)} ms  "
        f"stall {ms(p.max_stall)} ms  {p.throughput_tok_s:.1f} tok/s  errors {p.errors}"
    )


def write_outputs(out: Path, json_path: Path | None, report: dict, points: list[PointSummary]) -> None:
    path = json_path or out / "bench_serve.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    rows = report["points"]
    with (out / "bench_serve.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["mode"])
        w.writeheader()
        w.writerows(rows)
    from orchestrator.bench_plots import plot_all

    plot_all(out, report, points)
    print(f"[bench] wrote {path}, {out / 'bench_serve.csv'} and plots in {out}", flush=True)

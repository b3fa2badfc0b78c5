"""``disagg bench serve``: colocated vs disaggregated on equal hardware, one invocation (DESIGN section 6).

1. Calibrate on this machine (``calibrate``).
2. Launch both deployments side by side (``deploy``).
3. Per workload: idle measurements (one request at a time) give the SLOs: TTFT <= 3 x idle TTFT
   (the idle prefill), TPOT <= 1.5 x idle decode step. They double as the warm-up. The disaggregated
   decode node's placement ``auto`` gets the same 1.5 x the calibrated step as its ITL budget (set at
   launch, before any workload's idle step is measured): with streams decoding it prefills a prompt
   itself only in steps within that (``planner/placement.py``).
4. A request-rate sweep (``replay``: seeded Poisson arrivals, the same requests and schedule for
   both modes; the mode that goes first alternates per rate), each point bounded in time.
5. Per point the figures of ``metrics``; goodput = the highest rate with >= 90 % of requests
   inside both SLOs. JSON, CSV and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from bench.serve.calibrate import Calibration, calibrate
from bench.serve.deploy import MODES, Frontend, deployment, load_targets
from bench.serve.metrics import (
    Interval,
    PointSummary,
    bootstrap_goodput_ratio,
    bootstrap_itl_ratio,
    goodput,
    local_prefills,
    summarize,
    ttft_splits,
)
from bench.serve.replay import measure_idle, replay
from bench.serve.workloads import BenchRequest, Workload, make_requests, poisson_arrivals, save_requests
from builders import BuildOptions, build_engine
from builders.build import DEFAULT_ENGINE_CACHE, default_engine_dir
from orchestrator.launch import Launch
from planner.placement import PlacementSpec, PrefillPlacement
from torch_engine.config import DType, Role
from torch_engine.cpu import cpu_info
from torch_engine.tokenizer import Tokenizer

DRAIN_S = 30.0  # a point's bound is at least its last arrival plus this


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engine", type=Path, default=None, help="use this (fp32, TP 1) engine directory")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_ENGINE_CACHE)
    p.add_argument("--workloads", nargs="+", default=[w.value for w in Workload], choices=[w.value for w in Workload])
    p.add_argument("--requests", type=int, default=16, help="requests per rate point (the same file for both modes)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="request rates (req/s); default: multiples")
    p.add_argument("--rate-multiples", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 1.0],
                   help="of the estimated colocated saturation rate")  # fmt: skip
    p.add_argument("--prefill-ratio", type=float, default=10.0, help="prefill-heavy: prefill time / decode step")
    p.add_argument("--calibrate-lengths", type=int, nargs="+", default=[128, 160, 192, 224, 256, 320, 384, 512])
    p.add_argument("--chunk", type=int, default=128, help="token budget per step (chunked prefill)")
    p.add_argument("--cores", type=int, nargs=2, default=[0, 1], help="the two cores both modes get")
    p.add_argument("--layers-per-post", type=int, default=8,
                   help="disaggregated prefill: post KV every N finished layers (copies share its core)")  # fmt: skip
    p.add_argument("--placement", choices=[m.value for m in PrefillPlacement], default=PrefillPlacement.AUTO.value,
                   help="disaggregated: where prompts prefill (auto: per request, by measured costs)")  # fmt: skip
    # 7: the first warms up, the median of the other six sets the SLOs and the added-TTFT target (with 3, two samples
    # a mode gave an added TTFT of 45 ms in one run where eight gave -14 ms in the next hour: 2026-12-04)
    p.add_argument(
        "--idle-requests", type=int, default=7, help="serial requests for the idle baseline (the first warms up)"
    )
    p.add_argument("--max-seconds", type=float, default=150.0,
                   help="bound on one rate point (at least its last arrival + 30 s)")  # fmt: skip
    p.add_argument("--run-dtype", choices=["auto", *(d.value for d in DType)], default="auto",
                   help="dtype the engines compute in, in both modes and in the calibration")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--frontend",
        choices=[f.value for f in Frontend],
        default=Frontend.TRITON.value,
        help="send the load to the decode groups over Triton gRPC (round-robin) or through the router",
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench_serve"))
    p.add_argument("--json", type=Path, default=None, help="every figure and ratio (default OUT/bench_serve.json)")


@dataclass(frozen=True, slots=True)
class Options:
    engine_dir: Path
    workloads: list[Workload]
    requests: int
    rates: list[float] | None
    rate_multiples: list[float]
    prefill_ratio: float
    calibrate_lengths: list[int]
    chunk: int
    cores: list[int]
    layers_per_post: int
    placement: PrefillPlacement
    idle_requests: int
    max_seconds: float
    seed: int
    run_dtype: str
    frontend: Frontend
    out: Path
    json: Path
    command: str

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Options:
        opts = BuildOptions(role=Role.COLOCATED, tp_size=1, dtype=DType.FLOAT32, page_size=16)
        engine_dir = a.engine or build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts)
        out = Path(a.out).resolve()
        return cls(
            engine_dir, [Workload(w) for w in a.workloads], a.requests, a.rates, a.rate_multiples, a.prefill_ratio,
            a.calibrate_lengths, a.chunk, a.cores, a.layers_per_post, PrefillPlacement(a.placement),
            a.idle_requests, a.max_seconds, a.seed,
            a.run_dtype, Frontend(a.frontend), out, a.json or out / "bench_serve.json",
            "disagg bench serve " + " ".join(a.argv),
        )  # fmt: skip


@dataclass(slots=True)
class WorkloadReport:
    requests: int
    prompt_tokens_mean: float
    output_tokens_mean: float
    idle: dict[str, dict[str, float]]  # mode -> {"ttft", "itl"}
    slo: dict[str, float]
    rates: list[float]
    goodput: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Target:
    value: float | None
    target: float
    met: bool
    rate: float | None = None
    interval: Interval | None = None  # 95 % bootstrap interval of the ratio


TPOT_SLO_STEPS = 1.5  # the TPOT SLO in idle decode steps; the placement's ITL budget in calibrated ones


@dataclass(slots=True)
class ServeReport:
    command: str
    machine: dict[str, object]
    calibration: Calibration
    itl_budget_s: float | None = None  # the disaggregated placement's (auto), as launched; None: none
    workloads: dict[str, WorkloadReport] = field(default_factory=dict)
    points: list[PointSummary] = field(default_factory=list)
    targets: dict[str, Target] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        if self.calibration.profile is not None:
            data["calibration"]["profile"] = self.calibration.profile.model_dump(mode="json")
        data["points"] = [{k: v for k, v in p.items() if k not in ("itls", "request_itls")} for p in data["points"]]
        return data


def run(a: argparse.Namespace) -> int:
    opts = Options.from_args(a)
    opts.out.mkdir(parents=True, exist_ok=True)
    print(f"[bench] calibrating on {opts.engine_dir.name} (1 thread)", flush=True)
    run_dtype: DType | Literal["auto"] = "auto" if opts.run_dtype == "auto" else DType(opts.run_dtype)
    cal = calibrate(opts.engine_dir, opts.calibrate_lengths, opts.prefill_ratio, opts.chunk, run_dtype)
    print(
        f"[bench] decode step {1000 * cal.decode_step_s:.1f} ms; prefill-heavy prompt {cal.prefill_len} tokens "
        f"({cal.prefill_s[cal.prefill_len] / cal.decode_step_s:.1f} steps)",
        flush=True,
    )
    machine: dict[str, object] = {**cpu_info().as_dict(), "cores": os.cpu_count()}
    auto = opts.placement is PrefillPlacement.AUTO
    report = ServeReport(opts.command, machine, cal, TPOT_SLO_STEPS * cal.decode_step_s if auto else None)
    profile = opts.out / "profile.json"
    assert cal.profile is not None
    cal.profile.dump(profile)
    placement = PlacementSpec(mode=opts.placement, profile=profile if auto else None, itl_budget_s=report.itl_budget_s)
    launches = {
        m: Launch(
            deployment(
                m,
                opts.engine_dir,
                opts.out,
                opts.chunk,
                opts.cores,
                opts.layers_per_post,
                opts.run_dtype,
                opts.frontend,
                placement,
            )
        )
        for m in MODES
    }
    try:
        _start(launches, opts.frontend)
        tok = Tokenizer(opts.engine_dir)
        for wl in opts.workloads:
            _workload(opts, report, launches, make_requests(tok, wl, opts.requests, cal.prefill_len, opts.seed), wl)
    finally:
        for launch in launches.values():
            launch.stop()
    report.targets = targets(report)
    write_outputs(opts, report)
    print(json.dumps({k: asdict(v) for k, v in report.targets.items()}, indent=2))
    return 0


def _start(launches: dict[str, Launch], frontend: Frontend) -> None:
    for launch in launches.values():
        launch.prepare(progress=False)
        launch.start()
    for m, launch in launches.items():
        launch.wait_ready()
        print(f"[bench] {m} deployment ready: {', '.join(load_targets(launch, frontend).urls)}", flush=True)


def _workload(
    opts: Options, report: ServeReport, launches: dict[str, Launch], reqs: list[BenchRequest], wl: Workload
) -> None:
    """Idle baseline -> SLOs -> the rate sweep of one workload, both modes."""
    save_requests(opts.out / f"requests-{wl.value}.jsonl", reqs)
    to = {m: load_targets(launches[m], opts.frontend) for m in MODES}
    idle = {m: measure_idle(to[m], reqs[: opts.idle_requests], f"idle-{wl.value}-{m}") for m in MODES}
    ttft_idle, step_idle = idle["colocated"]["ttft"], idle["colocated"]["itl"]
    slo = (3 * ttft_idle, TPOT_SLO_STEPS * step_idle)
    mean_out = statistics.mean(r.max_tokens for r in reqs)
    sat = 2 / (ttft_idle + 0.25 * mean_out * step_idle)  # two replicas; decode amortised over ~4 streams
    rates = opts.rates or [round(m * sat, 3) for m in opts.rate_multiples]
    print(
        f"[bench] {wl.value}: SLO TTFT <= {slo[0]:.2f} s, TPOT <= {1000 * slo[1]:.0f} ms; "
        f"rates {rates} req/s (saturation estimate {sat:.2f})",
        flush=True,
    )
    points = []
    for ri, rate in enumerate(rates):
        arrivals = poisson_arrivals(len(reqs), rate, opts.seed)
        for m in MODES if ri % 2 == 0 else MODES[::-1]:
            tag = f"{wl.value}-{m}-r{ri}"
            bar = tqdm(total=len(reqs), desc=f"{wl.value} {m} {rate:.2f}/s", leave=False)
            cpu = time.process_time()
            bound = max(opts.max_seconds, arrivals[-1] + DRAIN_S)  # never cut a request before it was sent
            done, wall = asyncio.run(replay(to[m], reqs, arrivals, tag, bound, bar))
            cpu = time.process_time() - cpu
            bar.close()
            time.sleep(0.5)  # let the last trace lines land
            p = summarize(m, wl, rate, done, wall, slo, ttft_splits(launches[m].run_dir, tag))
            p.loadgen_cpu = cpu / wall if wall > 0 else 0.0
            p.local_prefills = local_prefills(launches[m].run_dir, tag)
            points.append(p)
            print(line(p), flush=True)
    report.points += points
    report.workloads[wl.value] = WorkloadReport(
        requests=len(reqs),
        prompt_tokens_mean=statistics.mean(r.prompt_tokens for r in reqs),
        output_tokens_mean=mean_out,
        idle=idle,
        slo={"ttft_s": slo[0], "tpot_s": slo[1]},
        rates=rates,
        goodput={m: goodput(points, m, wl.value) for m in MODES},
    )


def targets(report: ServeReport) -> dict[str, Target]:
    """The issue's targets, each with its measured ratio, a 95 % bootstrap interval and whether it is met."""
    out: dict[str, Target] = {}
    ph = report.workloads.get(Workload.PREFILL_HEAVY.value)
    if ph is not None:
        ci = bootstrap_goodput_ratio(report.points, Workload.PREFILL_HEAVY.value)
        out["goodput_ratio_prefill_heavy"] = Target(ci.value, 1.5, ci.value is not None and ci.value >= 1.5, None, ci)
        ttft_slo = ph.slo["ttft_s"]
        for rate in ph.rates:
            by = {p.mode: p for p in report.points if p.workload == Workload.PREFILL_HEAVY.value and p.rate == rate}
            if len(by) != 2:
                continue
            col = by["colocated"]
            if col.ttft_p90 is None or col.ttft_p90 > ttft_slo or col.errors:
                continue  # colocated no longer meets its TTFT SLO here (90 % inside it)
            ci = bootstrap_itl_ratio(col, by["disaggregated"])
            met = ci.value is not None and ci.value >= 1.8
            out[f"p99_itl_ratio_prefill_heavy@{rate}"] = Target(ci.value, 1.8, met, rate, ci)
        added = ph.idle["disaggregated"]["ttft"] - ph.idle["colocated"]["ttft"]
        floor = ph.prompt_tokens_mean * report.calibration.kv_bytes_per_token
        budget = floor / report.calibration.memcpy_bytes_per_s + ph.idle["colocated"]["itl"]
        out["added_ttft_prefill_heavy"] = Target(added, budget, added <= budget)
    dh = report.workloads.get(Workload.DECODE_HEAVY.value)
    if dh is not None:
        ci = bootstrap_goodput_ratio(report.points, Workload.DECODE_HEAVY.value)
        out["goodput_ratio_decode_heavy"] = Target(ci.value, 0.95, ci.value is not None and ci.value >= 0.95, None, ci)
    ch = report.workloads.get(Workload.CHAT.value)
    if ch is not None:
        ci = bootstrap_goodput_ratio(report.points, Workload.CHAT.value)
        out["goodput_ratio_chat"] = Target(ci.value, 1.0, ci.value is not None and ci.value >= 1.0, None, ci)
    return out


def line(p: PointSummary) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    return (
        f"[bench] {p.workload:13s} {p.mode:13s} {p.rate:6.3f}/s  SLO {100 * p.slo_attainment:5.1f}%  "
        f"TTFT p50/p99 {ms(p.ttft_p50)}/{ms(p.ttft_p99)} ms  ITL p50/p99 {ms(p.itl_p50)}/{ms(p.itl_p99)} ms  "
        f"stall {ms(p.max_stall)} ms ({100 * p.stalled_share:.1f}% of ITLs)  {p.throughput_tok_s:.1f} tok/s  "
        f"errors {p.errors}  "
        f"local prefills {p.local_prefills}  load generator {100 * p.loadgen_cpu:.0f}% of a core"
    )


def write_outputs(opts: Options, report: ServeReport) -> None:
    data = report.to_json()
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(data, indent=2), encoding="utf-8")
    rows: list[dict[str, object]] = [{k: v for k, v in p.items() if k != "ok"} for p in data["points"]]  # type: ignore[attr-defined]
    with (opts.out / "bench_serve.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["mode"])
        w.writeheader()
        w.writerows(rows)
    from bench.serve.plots import plot_all

    plot_all(opts.out, list(report.workloads), report.points)
    print(f"[bench] wrote {opts.json}, {opts.out / 'bench_serve.csv'} and plots in {opts.out}", flush=True)

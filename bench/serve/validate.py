"""``disagg plan --validate BENCH_JSON``: the planner's predictions for a measured serving benchmark.

``disagg plan`` is ``planner/cli.py``; this module adds ``--validate`` to it (it reads the benchmark's
own arguments and arrivals, so it lives in ``bench`` and the planner stays below the benchmarks).

Every rate point of a ``disagg bench serve`` run is simulated with the benchmark's own inputs: the
profile its calibration measured (one 1-thread engine process), its request files, the same seeded
Poisson arrivals, its deployments (colocated: two 1-core replicas, round-robin; disaggregated: one
prefill and one decode core, its placement mode and KV posting), its SLOs and its time bound.
Predicted and measured goodput and TTFT / TPOT percentiles are printed side by side with the error.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.serve.cli import add_arguments as bench_arguments
from bench.serve.workloads import poisson_arrivals
from planner import cli as plan_cli
from planner.placement import PrefillPlacement
from planner.profile import CostModel, HardwareProfile
from planner.simulator import Deployment, Mode, Role, SimResult, Simulator
from planner.workload import SLO, Workload

ATTAINMENT = 0.9
BENCH_MAX_SEQS = 32  # bench/serve/deploy.py's scheduler


def _bench_args(command: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_arguments(p)
    words = shlex.split(command)
    first = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))  # past "disagg bench serve"
    return p.parse_args(words[first:])


def deployments(
    costs: CostModel,
    args: argparse.Namespace,
    layers: int,
    request_overhead_s: float = 0.0,
    itl_budget_s: float | None = None,
) -> dict[str, Deployment]:
    chunk = args.chunk
    placement = PrefillPlacement(getattr(args, "placement", PrefillPlacement.AUTO.value))
    exposed = min(args.layers_per_post / layers, 1.0)
    return {
        "colocated": Deployment(
            Mode.COLOCATED, Role(costs, 2, chunk, BENCH_MAX_SEQS), request_overhead_s=request_overhead_s
        ),
        "disaggregated": Deployment(
            Mode.DISAGGREGATED,
            Role(costs, 1, chunk, BENCH_MAX_SEQS),
            Role(costs, 1, chunk, BENCH_MAX_SEQS),
            placement,
            exposed_share=exposed,
            request_overhead_s=request_overhead_s,
            itl_budget_s=itl_budget_s,
        ),
    }


@dataclass(frozen=True, slots=True)
class Compared:
    predicted: float | None
    measured: float | None

    @property
    def error(self) -> float | None:
        p, m = self.predicted, self.measured
        return None if p is None or not m else (p - m) / m


@dataclass(frozen=True, slots=True)
class PointCheck:
    workload: str
    mode: str
    rate: float
    attainment: Compared
    ttft_p50: Compared
    ttft_p99: Compared
    tpot_p50: Compared
    tpot_p99: Compared
    local_share: Compared


def serving_overheads(profile: HardwareProfile, wl: Workload, idle: dict[str, float] | None) -> tuple[float, float]:
    """What the serving path adds to the engine's own times, from the benchmark's idle requests
    (colocated, one at a time): per step (idle inter-token latency - a batch-1 decode step at the
    mean context) and per request (idle TTFT - the prompt's one-step prefill with that step cost)."""
    if not idle:
        return 0.0, 0.0
    bare = CostModel(profile)
    step = max(idle["itl"] - bare.decode_s(1, wl.mean_input + wl.mean_output / 2), 0.0)
    request = max(idle["ttft"] - CostModel(profile, step).prefill_s(int(wl.mean_input)), 0.0)
    return step, request


def validate(bench_json: Path, out: Path | None, layers: int = 30) -> int:
    data = json.loads(Path(bench_json).read_text(encoding="utf-8"))
    profile_raw = data["calibration"].get("profile")
    if profile_raw is None:
        raise ValueError(f"{bench_json}: no measured profile in its calibration (a run before `disagg plan` existed)")
    profile = HardwareProfile.model_validate(profile_raw)
    args = _bench_args(data["command"])
    checks: list[PointCheck] = []
    goodputs: dict[str, dict[str, Compared]] = {}
    for wl_name, w in data["workloads"].items():
        wl = Workload.from_file(Path(bench_json).parent / f"requests-{wl_name}.jsonl", wl_name)
        slo = SLO(w["slo"]["ttft_s"], w["slo"]["tpot_s"])
        step_s, request_s = serving_overheads(profile, wl, w.get("idle", {}).get("colocated"))
        print(f"[plan] {wl_name}: serving overheads from the idle requests: {1e3 * step_s:.1f} ms per step, "
              f"{1e3 * request_s:.1f} ms per request")  # fmt: skip
        deps = deployments(CostModel(profile, step_s), args, layers, request_s, data.get("itl_budget_s"))
        predicted_ok: dict[str, list[float]] = {m: [] for m in deps}
        for rate in w["rates"]:
            arrivals = poisson_arrivals(len(wl.requests), rate, args.seed)
            for mode, dep in deps.items():
                res = Simulator(dep).run(wl.requests, arrivals, rate, args.max_seconds)
                mine = (p for p in data["points"] if p["workload"] == wl_name and p["mode"] == mode)
                checks.append(check(wl_name, mode, rate, res, slo, next(p for p in mine if p["rate"] == rate)))
                if res.attainment(slo) >= ATTAINMENT:
                    predicted_ok[mode].append(rate)
        goodputs[wl_name] = {m: Compared(max(predicted_ok[m], default=0.0), w["goodput"][m]) for m in deps}
    print(table(checks))
    for wl_name, g in goodputs.items():
        print(f"[plan] {wl_name} goodput (req/s): " + "; ".join(
            f"{m} predicted {v.predicted:.3f} / measured {v.measured:.3f}" for m, v in g.items()))  # fmt: skip
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"points": [asdict(c) for c in checks], "goodput": {k: {m: asdict(v) for m, v in g.items()}
               for k, g in goodputs.items()}}  # fmt: skip
        out.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    return 0


def check(wl: str, mode: str, rate: float, res: SimResult, slo: SLO, meas: dict[str, Any]) -> PointCheck:
    def c(what: str, q: int) -> Compared:
        return Compared(res.pct(what, q), meas.get(f"{what}_p{q}"))

    local = meas.get("local_prefills", 0) / max(meas["requests"], 1)
    return PointCheck(
        wl, mode, rate, Compared(res.attainment(slo), meas["slo_attainment"]),
        c("ttft", 50), c("ttft", 99), c("tpot", 50), c("tpot", 99), Compared(res.local_share, local),
    )  # fmt: skip


def _cell(x: Compared) -> str:
    p, m, e = x.predicted, x.measured, x.error
    if p is None or m is None:
        return "-"
    return f"{1e3 * p:.0f} / {1e3 * m:.0f}" + (f" ({100 * e:+.0f}%)" if e is not None else "")


def table(checks: list[PointCheck]) -> str:
    lines = [
        "| workload | rate | mode | in SLO pred / meas | TTFT p50 pred / meas (ms) | TTFT p99 | TPOT p50 | TPOT p99 |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in checks:
        att = f"{100 * (r.attainment.predicted or 0):.0f}% / {100 * (r.attainment.measured or 0):.0f}%"
        lines.append(
            f"| {r.workload} | {r.rate} | {r.mode} | {att} | {_cell(r.ttft_p50)} | {_cell(r.ttft_p99)} | "
            f"{_cell(r.tpot_p50)} | {_cell(r.tpot_p99)} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    plan_cli.add_arguments(p)
    p.add_argument("--validate", type=Path, default=None, help="a bench serve JSON: predict its points and compare")


def run(a: argparse.Namespace) -> int:
    if a.validate is not None:
        return validate(a.validate, a.json)
    return plan_cli.run(a)

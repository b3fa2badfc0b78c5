"""What one rate point of the serving benchmark measured: TTFT / ITL / TPOT percentiles, the longest
stall, throughput, SLO attainment and the TTFT split (queue / prefill / transfer / handover) from
the nodes' traces; goodput over points; the targets with their measured ratios."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.serve.workloads import Workload
from orchestrator.client import Completion
from serving.trace import read_trace

ATTAINMENT = 0.9


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


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


def local_prefills(run_dir: Path, tag: str) -> int:
    """Requests of a point that a disaggregated decode node prefilled itself (its ``placed`` marks)."""
    n = 0
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        if path.name.startswith("prefill"):
            continue
        mine = (r for r in read_trace(path) if str(r["request_id"]).startswith(tag + "-"))
        n += sum(1 for r in mine if r.get("where") == "local")
    return n


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
    loadgen_cpu: float = 0.0  # CPU the load generator used during the point, in cores (it shares the machine)
    local_prefills: int = 0  # disaggregated: requests the decode node prefilled itself (placement rule)
    # inter-token intervals over twice the TPOT SLO (3x the idle ITL): those a prefill (or another stall)
    # stretched. The p99 ITL shows stalls only where this share is above 1 %.
    stalled_share: float = 0.0
    itls: list[float] = field(default_factory=list)
    # per request, for the bootstrap: inside both SLOs, and its inter-token latencies
    ok: list[bool] = field(default_factory=list)
    request_itls: list[list[float]] = field(default_factory=list)


def summarize(
    mode: str, workload: Workload, rate: float, done: list[Completion], wall: float, slo: tuple[float, float],
    splits: dict[str, Split],
) -> PointSummary:  # fmt: skip
    ttft_slo, tpot_slo = slo
    ttfts, itls, tpots, tokens = [], [], [], 0
    oks: list[bool] = []
    per_request: list[list[float]] = []
    for c in done:
        if c.error is not None or c.ttft is None:  # errors and timeouts are misses
            oks.append(False)
            per_request.append([])
            continue
        ttfts.append(c.ttft)
        itls += c.itls
        tokens += len(c.times)
        tpot = (c.times[-1] - c.times[0]) / (len(c.times) - 1) if len(c.times) > 1 else 0.0
        tpots.append(tpot)
        oks.append(c.ttft <= ttft_slo and tpot <= tpot_slo)
        per_request.append(list(c.itls))
    ok = sum(oks)
    sp = list(splits.values())

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return PointSummary(
        mode, workload.value, rate, len(done), sum(c.error is not None for c in done), wall,
        pct(ttfts, 50), pct(ttfts, 90), pct(ttfts, 99), pct(itls, 50), pct(itls, 90), pct(itls, 99),
        pct(tpots, 50), pct(tpots, 90), pct(tpots, 99), max(itls) if itls else None,
        tokens / wall if wall > 0 else 0.0, ok / len(done) if done else 0.0,
        med([s.queue for s in sp]), med([s.prefill for s in sp]), med([s.transfer for s in sp]),
        med([s.handover for s in sp]), itls=itls, ok=oks, request_itls=per_request,
        stalled_share=sum(x > 2 * tpot_slo for x in itls) / len(itls) if itls else 0.0,
    )  # fmt: skip


def goodput(points: list[PointSummary], mode: str, workload: str) -> float:
    ok = [p.rate for p in points if p.mode == mode and p.workload == workload and p.slo_attainment >= ATTAINMENT]
    return max(ok, default=0.0)


@dataclass(frozen=True, slots=True)
class Interval:
    value: float | None  # the ratio measured
    low: float | None  # 2.5th percentile of the bootstrap
    high: float | None  # 97.5th
    defined: float  # share of resamples in which the ratio was defined (a zero denominator is not)


def _interval(value: float | None, samples: list[float], resamples: int) -> Interval:
    if not samples:
        return Interval(value, None, None, 0.0)
    s = sorted(samples)
    return Interval(value, pct(s, 2.5), pct(s, 97.5), len(s) / resamples)


def bootstrap_goodput_ratio(
    points: list[PointSummary], workload: str, resamples: int = 1000, seed: int = 0
) -> Interval:
    """Disaggregated / colocated goodput, with a 95 % interval from resampling each point's requests."""
    rng = random.Random(seed)
    mine = [p for p in points if p.workload == workload and p.ok]
    col, dis = goodput(points, "colocated", workload), goodput(points, "disaggregated", workload)
    samples = []
    for _ in range(resamples):
        best = {"colocated": 0.0, "disaggregated": 0.0}
        for p in mine:
            draw = rng.choices(p.ok, k=len(p.ok))
            if sum(draw) / len(draw) >= ATTAINMENT:
                best[p.mode] = max(best[p.mode], p.rate)
        if best["colocated"] > 0:
            samples.append(best["disaggregated"] / best["colocated"])
    return _interval(dis / col if col else None, samples, resamples)


def bootstrap_itl_ratio(col: PointSummary, dis: PointSummary, resamples: int = 1000, seed: int = 0) -> Interval:
    """p99 ITL colocated / disaggregated at one rate, with a 95 % interval (requests resampled)."""
    rng = random.Random(seed)

    def p99(p: PointSummary) -> float | None:
        draw = rng.choices(p.request_itls, k=len(p.request_itls))
        return pct([x for r in draw for x in r], 99)

    samples = []
    for _ in range(resamples):
        a, b = p99(col), p99(dis)
        if a is not None and b:
            samples.append(a / b)
    value = (col.itl_p99 / dis.itl_p99) if col.itl_p99 is not None and dis.itl_p99 else None
    return _interval(value, samples, resamples)

"""What one rate point of the serving benchmark measured: TTFT / ITL / TPOT percentiles, the longest
stall, throughput, SLO attainment and the TTFT split (queue / prefill / transfer / handover) from
the nodes' traces; goodput over points; the targets with their measured ratios."""

from __future__ import annotations

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

"""What ``disagg plan`` reports of each evaluated plan: its figures, a row, the markdown table (the
CLI prints it, ``planner.plots`` draws it)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.search import Evaluated
from planner.simulator import SimResult


@dataclass(frozen=True, slots=True)
class Figures:
    """One simulation's percentiles, placement share, engine busy shares and median TTFT split."""

    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    local_share: float
    utilization: dict[str, float]
    split_queue: float | None
    split_prefill: float | None
    split_transfer: float | None
    split_handover: float | None

    @classmethod
    def of(cls, r: SimResult) -> Figures:
        return cls(
            r.pct("ttft", 50), r.pct("ttft", 99), r.pct("tpot", 50), r.pct("tpot", 99), r.local_share, r.utilization,
            r.median("queue"), r.median("prefill"), r.median("transfer"), r.median("handover"),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PlanRow:
    label: str
    mode: str
    devices: int
    goodput: float
    goodput_per_device: float
    figures: Figures | None  # at its goodput (None: no goodput)


def row(ev: Evaluated, res: SimResult | None = None) -> PlanRow:
    r = res or ev.at_goodput
    d = ev.deployment
    return PlanRow(ev.label, d.mode.name.lower(), d.devices, ev.goodput, ev.per_device, Figures.of(r) if r else None)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def table(rows: list[PlanRow]) -> str:
    head = ("| plan | devices | goodput (req/s) | per device | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
            "| local prefills | busy | TTFT split q / prefill / transfer / handover (ms) |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        f = r.figures
        if f is None:
            lines.append(f"| {r.label} | {r.devices} | 0 | 0 | - | - | - | - | - |")
            continue
        busy = ", ".join(f"{k} {100 * v:.0f}%" for k, v in f.utilization.items())
        split = " / ".join(ms(x) for x in (f.split_queue, f.split_prefill, f.split_transfer, f.split_handover))
        ttft, tpot = f"{ms(f.ttft_p50)} / {ms(f.ttft_p99)}", f"{ms(f.tpot_p50)} / {ms(f.tpot_p99)}"
        lines.append(
            f"| {r.label} | {r.devices} | {r.goodput:.3f} | {r.goodput_per_device:.3f} | {ttft} | {tpot} | "
            f"{100 * f.local_share:.0f}% | {busy} | {split} |"
        )
    return "\n".join(lines)

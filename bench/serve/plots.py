"""PNG plots of ``disagg bench serve``: SLO attainment vs rate, ITL CDF, TTFT breakdown."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from bench.serve.metrics import PointSummary

COLORS = {"colocated": "tab:orange", "disaggregated": "tab:blue"}


def plot_all(out: Path, workloads: list[str], points: list[PointSummary]) -> None:
    for wl in workloads:
        mine = [p for p in points if p.workload == wl]
        if mine:
            _attainment(out / f"slo-attainment-{wl}.png", wl, mine)
            _itl_cdf(out / f"itl-cdf-{wl}.png", wl, mine)
            _ttft_split(out / f"ttft-breakdown-{wl}.png", wl, mine)


def _attainment(path: Path, wl: str, points: list[PointSummary]) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, color in COLORS.items():
        ps = sorted((p for p in points if p.mode == mode), key=lambda p: p.rate)
        ax.plot([p.rate for p in ps], [100 * p.slo_attainment for p in ps], "o-", color=color, label=mode)
    ax.axhline(90, color="gray", linestyle="--", linewidth=1, label="90 % (goodput)")
    ax.set(xlabel="request rate (req/s)", ylabel="requests inside TTFT and TPOT SLOs (%)", ylim=(0, 105))
    ax.set_title(f"SLO attainment vs rate: {wl}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _itl_cdf(path: Path, wl: str, points: list[PointSummary]) -> None:
    """ITL CDFs at the lowest and the highest rate of the sweep, both modes."""
    rates = sorted({p.rate for p in points})
    shown = [rates[0], rates[-1]] if len(rates) > 1 else rates
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4), squeeze=False)
    for ax, rate in zip(axes[0], shown, strict=True):
        for mode, color in COLORS.items():
            p = next((p for p in points if p.mode == mode and p.rate == rate), None)
            if p is None or not p.itls:
                continue
            xs = sorted(1000 * x for x in p.itls)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], color=color, label=mode)
        ax.set(xlabel="inter-token latency (ms)", ylabel="fraction of tokens", xscale="log")
        ax.set_title(f"ITL CDF at {rate:.2f} req/s: {wl}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ttft_split(path: Path, wl: str, points: list[PointSummary]) -> None:
    """Median TTFT split per mode and rate, stacked."""
    ps = sorted(points, key=lambda p: (p.rate, p.mode))
    labels = [f"{p.rate:.2f}\n{p.mode[:5]}" for p in ps]
    parts = [("queue", "split_queue"), ("prefill", "split_prefill"), ("transfer", "split_transfer"),
             ("handover", "split_handover")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(ps)), 4))
    bottom = [0.0] * len(ps)
    for name, attr in parts:
        vals = [1000 * (getattr(p, attr) or 0.0) for p in ps]
        ax.bar(range(len(ps)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(ps)), labels, fontsize=7)
    ax.set(ylabel="median TTFT split (ms)", xlabel="rate (req/s) / mode")
    ax.set_title(f"TTFT breakdown (server-side): {wl}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

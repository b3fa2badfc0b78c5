"""The plot of ``disagg plan --plot``: goodput per device of every plan, by mode."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from planner.report import PlanRow

COLORS = {"colocated": "tab:orange", "disaggregated": "tab:blue"}


def plot_plans(path: Path, rows: list[PlanRow]) -> None:
    rows = sorted(rows, key=lambda r: r.goodput_per_device)
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.35 * len(rows) + 1)))
    ax.barh([r.label for r in rows], [r.goodput_per_device for r in rows], color=[COLORS[r.mode] for r in rows])
    ax.set(xlabel="goodput per device (req/s with >= 90 % inside both SLOs)")
    ax.set_title("disagg plan: colocated (orange) vs disaggregated (blue)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

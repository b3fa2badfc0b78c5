"""``disagg bench serve`` for real: both deployments, a tiny sweep, every output written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagg.cli import main
from planner.profile import HardwareProfile, ProfileSource


def test_bench_serve_runs_both_modes_and_writes_everything(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = ["bench", "serve", "--engine", str(smollm2_dir), "--workloads", "prefill-heavy", "--requests", "3",
            "--rates", "0.3", "--idle-requests", "2", "--calibrate-lengths", "48", "96", "--max-seconds", "120",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "bench_serve.json").read_text(encoding="utf-8"))
    points = report["points"]
    assert {p["mode"] for p in points} == {"colocated", "disaggregated"}
    assert all(p["errors"] == 0 and p["ttft_p50"] > 0 and p["itl_p99"] > 0 for p in points)
    disagg = next(p for p in points if p["mode"] == "disaggregated")
    # placement auto (the default) on the calibrated profile: an idle decode node keeps a 96-token prompt; with
    # streams decoding it prefills only in steps within 1.5 calibrated decode steps (the TPOT SLO's factor)
    assert disagg["local_prefills"] >= 1
    assert report["itl_budget_s"] == pytest.approx(1.5 * report["calibration"]["decode_step_s"])
    if disagg["local_prefills"] < 3:  # some went to the prefill node: their traces are joined across nodes
        assert disagg["split_prefill"] > 0 and disagg["split_transfer"] is not None
    targets = report["targets"]
    assert {"goodput_ratio_prefill_heavy", "added_ttft_prefill_heavy"} <= set(targets)
    assert "interval" in targets["goodput_ratio_prefill_heavy"]  # the bootstrap ran (undefined without goodput)
    assert all(0 <= p["loadgen_cpu"] < 2 and len(p["ok"]) == 3 for p in points)  # per request, errors as misses
    profile = HardwareProfile.load(out / "profile.json")  # the placement rule's curves, measured in the calibration
    assert profile.source is ProfileSource.MEASURED and profile.prefill[0][1] > 0
    for name in ("bench_serve.csv", "slo-attainment-prefill-heavy.png", "itl-cdf-prefill-heavy.png",
                 "ttft-breakdown-prefill-heavy.png", "requests-prefill-heavy.jsonl"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name

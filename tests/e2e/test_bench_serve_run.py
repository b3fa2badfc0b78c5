"""``disagg bench serve`` for real: both deployments, a tiny sweep, every output written."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.cli import main


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
    assert disagg["split_prefill"] > 0 and disagg["split_transfer"] is not None  # traces joined across nodes
    assert set(report["targets"]) >= {"goodput_ratio_prefill_heavy", "p99_itl_ratio_prefill_heavy"}
    for name in ("bench_serve.csv", "slo-attainment-prefill-heavy.png", "itl-cdf-prefill-heavy.png",
                 "ttft-breakdown-prefill-heavy.png", "requests-prefill-heavy.jsonl"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name

"""``disagg bench engine`` end to end on a tiny engine: every figure present and consistent."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.cli import main


def test_bench_engine_reports_points_floor_and_path(tiny_engine_dir, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "engine", "--engine", str(tiny_engine_dir("llama", page_size=4)), "--threads", "1",
            "--batch", "1", "2", "--prompt-len", "8", "--decode-tokens", "3", "--repeats", "1", "--no-hf",
            "--no-llamacpp", "--run-dtype", "float32", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["dtype"] == "float32" and report["kernel_path"].startswith("cpu/float32/onednn-packed/")
    assert report["cpu"]["model"] and isinstance(report["cpu"]["flags"], list)
    one = report["by_threads"]["1"]
    assert one["read_GBps"] > 0 and one["copy_GBps"] > 0
    p1, p2 = one["points"]["1"], one["points"]["2"]
    assert p1["aggregate_over_batch1"] == 1.0 and p2["aggregate_over_batch1"] > 0
    for p in (p1, p2):
        assert p["engine_decode_step_ms"] > 0 and p["floor_ms"] > 0
        assert abs(p["step_over_floor"] - p["engine_decode_step_ms"] / p["floor_ms"]) < 1e-9
        assert p["hf_decode_tok_s"] is None  # --no-hf
    assert p2["floor_ms"] > p1["floor_ms"]  # twice the KV read
    assert "batch1_within_1.2x_floor_1t" in report["goals"]

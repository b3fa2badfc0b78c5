"""``disagg bench engine`` end to end on a tiny engine: every figure present and consistent."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.cli import main
from torch_engine.kernels import cpu_kernels


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
    assert "batch1_within_1.3x_floor_1t" in report["goals"]
    assert "batch8_over_batch1_step_at_most_1.5_one_thread" not in report["goals"]  # no batch 8 here


def test_bench_engine_quality_compares_with_the_dequantised_path(smollm2_dir: Path, tmp_path: Path) -> None:
    """``--quality``: perplexities of the dequantised path, the fp32 reference, the decode path and 16-token
    prefill on the fixed text (its first 96 tokens here), the agreement, and the goal it judges."""
    out = tmp_path / "bench.json"
    args = ["bench", "engine", "--engine", str(smollm2_dir), "--threads", "1", "--batch", "1", "--prompt-len",
            "8", "--decode-tokens", "2", "--repeats", "1", "--no-hf", "--no-llamacpp", "--run-dtype", "float32",
            "--quality", "96", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    q = json.loads(out.read_text(encoding="utf-8"))["quality"]
    assert q["tokens"] == 96 and q["dtype"] == "float32"
    assert q["ppl_dequantised"] == q["ppl_fp32"] > 1  # fp32 run: the dequantised path is the fp32 reference
    for key in ("ppl_decode", "ppl_prefill"):
        assert 0.9 < q[key] / q["ppl_dequantised"] < 1.1
    assert 0.8 <= q["top1_agreement"] <= 1.0
    assert "perplexity_within_0.5pct_of_the_dequantised_path" in json.loads(out.read_text())["goals"]
    # `dtype: auto` turns the fast path on by itself: the reference must still be the dequantised path (it was
    # the fast path, and the comparison 1.0 exactly, once prefill rows took the integer GEMM too)
    args[args.index("float32")] = "auto"
    assert main(args) == 0
    q = json.loads(out.read_text(encoding="utf-8"))["quality"]
    assert 0.9 < q["ppl_prefill"] / q["ppl_dequantised"] < 1.1
    if cpu_kernels() is not None:  # the integer kernels: the two paths differ in the activations' rounding
        assert q["ppl_prefill"] != q["ppl_dequantised"]

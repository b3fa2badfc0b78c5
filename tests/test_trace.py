"""Per-request traces: every record is written once, also for requests that end early."""

from __future__ import annotations

from pathlib import Path

from serving.trace import Tracer, read_trace


def test_early_ends_close_their_record_once(tmp_path: Path) -> None:
    t = Tracer(tmp_path / "decode0.jsonl", "decode0")
    t.mark("a", "arrived", prompt_tokens=3)
    t.mark("b", "arrived")
    t.finish("a", cached_tokens=0)
    t.close("b", "failed", error="sampling failed")
    t.close("b", "aborted")  # a second end of the same request: nothing more
    t.close("never-seen", "aborted")
    assert t.open_records() == 0
    lines = read_trace(tmp_path / "decode0.jsonl")
    assert [r["request_id"] for r in lines] == ["a", "b"]
    assert lines[0]["cached_tokens"] == 0 and "finished" in lines[0]
    assert lines[1]["error"] == "sampling failed" and "failed" in lines[1] and "aborted" not in lines[1]

"""``disagg bench prefix``: its workloads and its arithmetic (the run itself needs deployments)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serve.prefix import NodeView, Sample, conversations, node_view, ratios, shared_prefix, summarize
from orchestrator.client import Completion
from torch_engine.tokenizer import Tokenizer


def sample(rid: str, turn: int, ttft: float, prompt: int, cached: int) -> Sample:
    c = Completion(rid, 0.0)
    c.times, c.pieces = [ttft, ttft + 0.1, ttft + 0.2], ["x"] * 3
    c.prompt_tokens, c.cached_tokens = prompt, cached
    return Sample(rid, turn, 3, c)


def test_workloads_are_seeded_and_shaped(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir)
    convs = conversations(tok, 3, 0.5, 1.0, seed=1)
    assert convs == conversations(tok, 3, 0.5, 1.0, seed=1)
    assert len({c.system for c in convs}) == 1 and 1000 <= len(tok.encode(convs[0].system)) <= 2048
    assert all(4 <= len(c.turns) <= 8 for c in convs) and convs[0].start_s == 0.0 < convs[1].start_s
    shared = shared_prefix(tok, 12, 3, seed=1)
    assert len(shared) == 12 and len({p[:200] for p, _ in shared}) <= 3  # a few system prompts, many users


def test_points_and_ratios(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    decode = [
        {"request_id": f"mt-disaggregated-on-c0t{t}#1.decode0-1", "cached_tokens": c} for t, c in [(0, 0), (1, 96)]
    ]
    prefill = [{"request_id": f"mt-disaggregated-on-c0t{t}#1.decode0-1", "kv_bytes": b, "prefill_cached_tokens": 0}
               for t, b in [(0, 1000), (1, 50)]]  # fmt: skip
    (traces / "decode0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decode))
    (traces / "prefill0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prefill))
    view = node_view(tmp_path, "mt-disaggregated-on")
    assert view.decoder_cached == {"mt-disaggregated-on-c0t0": 0, "mt-disaggregated-on-c0t1": 96}
    on_samples = [
        sample("mt-disaggregated-on-c0t0", 0, 1.0, 100, 0),
        sample("mt-disaggregated-on-c0t1", 1, 0.1, 120, 96),
    ]
    on = summarize("multi-turn", "disaggregated", "on", on_samples, 10.0, view, (0.5, 0.2))
    assert on.cached_tokens_exact and on.decoder_hit_rate == pytest.approx(96 / 220)
    assert on.goodput_req_s == pytest.approx(0.1)  # one request inside the TTFT SLO in 10 s
    off_view = NodeView(kv_bytes={"mt-disaggregated-off-c0t0": 1000, "mt-disaggregated-off-c0t1": 1100})
    off_samples = [
        sample("mt-disaggregated-off-c0t0", 0, 1.0, 100, 0),
        sample("mt-disaggregated-off-c0t1", 1, 1.2, 120, 0),
    ]
    off = summarize("multi-turn", "disaggregated", "off", off_samples, 10.0, off_view, (0.5, 0.2))
    assert not off.cached_tokens_exact  # usage said 0, the node said nothing: not the same
    got = ratios([off, on])
    assert got["multi_turn_warm_kv_bytes_on_over_off_max"] == pytest.approx(50 / 1100)

"""``disagg bench serve``: the metrics arithmetic, the workloads, and one small real run of both modes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.serve.metrics import PointSummary, goodput, pct, summarize, ttft_splits
from bench.serve.overload import rss_mib, status_of
from bench.serve.workloads import Workload, make_requests, poisson_arrivals
from orchestrator.client import Completion
from torch_engine.tokenizer import Tokenizer


def completion(rid: str, sent: float, times: list[float], error: str | None = None) -> Completion:
    c = Completion(rid, sent)
    c.times, c.pieces, c.error = times, ["x"] * len(times), error
    return c


def test_percentiles_and_point_summary() -> None:
    assert pct([], 50) is None
    assert pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    done = [
        completion("a", 0.0, [0.5, 0.6, 0.7, 0.8]),  # TTFT 0.5, TPOT 0.1: inside both SLOs
        completion("b", 0.0, [2.5, 2.6, 2.7]),  # TTFT too long
        completion("c", 0.0, [0.4, 1.4]),  # TPOT 1.0: too slow; a 1 s stall
        completion("d", 0.0, [], "not finished within the 10 s bound"),
    ]
    p = summarize("colocated", Workload.CHAT, 1.0, done, wall=10.0, slo=(1.0, 0.2), splits={})
    assert p.requests == 4 and p.errors == 1
    assert p.slo_attainment == 0.25  # only "a"; the error counts as a miss
    assert p.ttft_p50 == 0.5 and p.max_stall == pytest.approx(1.0)
    assert p.stalled_share == pytest.approx(1 / 6)  # of 6 intervals, only c's 1 s is over 2 x the TPOT SLO
    assert p.throughput_tok_s == pytest.approx(0.9)  # 9 streamed pieces in 10 s
    assert p.tpot_p99 == pytest.approx(1.0)


def test_goodput_is_the_highest_rate_with_90_percent_inside_the_slos() -> None:
    def pt(mode: str, rate: float, att: float) -> PointSummary:
        p = summarize(mode, Workload.CHAT, rate, [], 1.0, (1.0, 1.0), {})
        p.slo_attainment = att
        return p

    pts = [pt("colocated", 0.5, 1.0), pt("colocated", 1.0, 0.91), pt("colocated", 2.0, 0.5)]
    pts.append(pt("disaggregated", 0.5, 0.8))
    assert goodput(pts, "colocated", "chat") == 1.0
    assert goodput(pts, "disaggregated", "chat") == 0.0


def test_ttft_split_from_traces(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    dec = {"request_id": "w-1#9", "arrived": 10.0, "sent": 10.01, "kv_ready": 11.2, "scheduled": 11.21,
           "first_token": 11.3}  # fmt: skip
    pre = {"request_id": "w-1#9", "received": 10.02, "scheduled": 10.1, "prefilled": 11.1, "kv_sent": 11.15}
    (traces / "decode0.tp0.jsonl").write_text(json.dumps(dec) + "\n", encoding="utf-8")
    (traces / "prefill0.tp0.jsonl").write_text(json.dumps(pre) + "\n", encoding="utf-8")
    s = ttft_splits(tmp_path, "w")["w-1"]
    assert (s.queue, s.prefill, s.transfer, s.handover) == pytest.approx((0.1, 1.0, 0.1, 0.1))
    colo = {"request_id": "c-2#1", "arrived": 5.0, "scheduled": 5.5, "first_token": 6.0}
    (traces / "decode1.tp0.jsonl").write_text(json.dumps(colo) + "\n", encoding="utf-8")
    s = ttft_splits(tmp_path, "c")["c-2"]
    assert (s.queue, s.prefill, s.transfer, s.handover) == pytest.approx((0.5, 0.5, 0.0, 0.0))


def test_workloads_are_seeded_and_shaped(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir)
    a = make_requests(tok, Workload.PREFILL_HEAVY, 4, 200, seed=1)
    assert a == make_requests(tok, Workload.PREFILL_HEAVY, 4, 200, seed=1)
    assert a != make_requests(tok, Workload.PREFILL_HEAVY, 4, 200, seed=2)
    assert all(180 <= r.prompt_tokens <= 200 and 64 <= r.max_tokens <= 128 for r in a)
    d = make_requests(tok, Workload.DECODE_HEAVY, 4, 200, seed=1)
    assert all(r.prompt_tokens <= 48 and r.max_tokens >= 128 for r in d)
    arr = poisson_arrivals(200, 2.0, seed=3)
    assert arr == poisson_arrivals(200, 2.0, seed=3) and arr[0] == 0.0
    assert 60 < arr[-1] < 140  # ~200 arrivals at 2/s


def test_each_point_salts_its_requests_so_no_point_reads_another_ones_cache(monkeypatch) -> None:
    """The same prompts are replayed at every rate (and in the idle baseline): with the prefix cache on,
    a later point would measure cache hits, not prefill. Each point's tag is its requests' cache salt,
    over Triton and through the router."""
    import asyncio

    from bench.serve import replay as rp
    from bench.serve.deploy import Frontend, Targets
    from bench.serve.workloads import BenchRequest

    salts: list[tuple[str, str | None]] = []

    async def fake_generate(client: object, prompt: str, max_tokens: int, rid: str, **kw: object) -> Completion:
        salts.append((rid, kw.get("cache_salt")))  # type: ignore[arg-type]
        return Completion(rid, 0.0)

    async def fake_router(url: str, model: str, prompt: str, max_tokens: int, rid: str, *a: object, **kw: object):
        salts.append((rid, kw.get("cache_salt")))  # type: ignore[arg-type]
        return Completion(rid, 0.0)

    monkeypatch.setattr(rp, "generate", fake_generate)
    monkeypatch.setattr(rp, "complete_via_router", fake_router)
    reqs = [BenchRequest("a b c", 3, 2), BenchRequest("d e f", 3, 2)]
    for frontend, urls in ((Frontend.TRITON, ["127.0.0.1:1"]), (Frontend.ROUTER, ["http://127.0.0.1:1/v1"])):
        for tag in ("prefill-heavy-colocated-r0", "prefill-heavy-colocated-r1"):
            asyncio.run(rp.replay(Targets(frontend, urls, "m"), reqs, [0.0, 0.0], tag, 10))
    assert salts == [(f"{t}-{i}", t) for _ in range(2) for t in ("prefill-heavy-colocated-r0",
                     "prefill-heavy-colocated-r1") for i in range(2)]  # fmt: skip


def test_the_overload_bench_reads_each_answer_and_the_memory_of_live_processes() -> None:
    assert status_of(completion("a", 0.0, [0.1, 0.2])) == 200
    assert status_of(completion("b", 0.0, [], 'HTTP 429: {"error": {}}')) == 429
    assert status_of(completion("c", 0.0, [], "HTTP 503: no slot freed within 0.1 s")) == 503
    assert status_of(completion("d", 0.0, [0.1], "decode group a failed mid-stream")) == 0  # an error after tokens
    assert status_of(completion("e", 0.0, [])) == 0  # no error, but not a token either
    mine = rss_mib({os.getpid()})
    assert 10 < mine < 24 * 1024 and rss_mib({os.getpid(), 2**22 + 7}) == mine  # a pid that is gone counts 0

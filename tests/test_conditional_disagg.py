"""Conditional disaggregation on a decode node (``KVFetcher`` + ``planner/placement.py``): prompts are
prefilled here or at a prefill group as the mode and the cost curves say, the tokens are the same
either way, and the choice is counted and traced."""

from __future__ import annotations

from pathlib import Path

from planner.placement import PlacementSpec, PrefillPlacement
from planner.profile import HardwareProfile
from serving.trace import Tracer, read_trace
from tests.helpers import linear_profile, prompt_of, tiny_engine
from tests.split_harness import GREEDY, ScriptedCaller, cluster, wait_for
from torch_engine.sampling import SamplingParams

Outcome = tuple[list[list[int]], tuple[int, int]]  # tokens per request, (local, remote) prefills


def _run(tiny_engine_dir, placement: PlacementSpec, tracer: Tracer | None = None) -> Outcome:
    c = cluster(tiny_engine_dir, placement=placement, tracer=tracer)
    try:
        prompts = {f"r{i}": prompt_of(6 + 5 * i, 30 + i) for i in range(4)}
        outs = c.run(prompts)  # one at a time would be idle; four at once load the engine
        assert all(o.error is None for o in outs.values())
        wait_for(c.settled, what="every page back")
        if tracer is not None:  # the server's part: a request's trace line is written when it finishes
            for rid in prompts:
                tracer.finish(rid)
        return [outs[r].output_ids for r in prompts], c.fetcher.prefill_counts()
    finally:
        c.stop()


def _plain(tiny_engine_dir) -> list[list[int]]:
    prompts = [prompt_of(6 + 5 * i, 30 + i) for i in range(4)]
    return tiny_engine(tiny_engine_dir("llama")).generate(prompts, GREEDY)


def test_forced_local_and_remote_placement_give_the_same_tokens(tiny_engine_dir) -> None:
    plain = _plain(tiny_engine_dir)
    local, counts = _run(tiny_engine_dir, PlacementSpec(mode=PrefillPlacement.LOCAL))
    assert local == plain and counts == (4, 0)
    remote, counts = _run(tiny_engine_dir, PlacementSpec(mode=PrefillPlacement.REMOTE))
    assert remote == plain and counts == (0, 4)


def test_auto_placement_follows_the_cost_curves(tiny_engine_dir, tmp_path: Path) -> None:
    plain = _plain(tiny_engine_dir)
    same = tmp_path / "same.json"
    linear_profile(per_token=0.01).dump(same)  # both roles alike: an idle engine keeps short prompts
    tracer = Tracer(tmp_path / "trace.jsonl", "decode0")
    out, (local, remote) = _run(tiny_engine_dir, PlacementSpec(mode=PrefillPlacement.AUTO, profile=same), tracer)
    assert out == plain and local >= 1 and local + remote == 4
    placed = [r for r in read_trace(tmp_path / "trace.jsonl") if "where" in r]
    assert len(placed) == 4 and all(isinstance(r["local_s"], float) and r["local_s"] > 0 for r in placed)
    assert all(isinstance(r["remote_s"], float) and r["remote_s"] > 0 for r in placed)
    assert sum(r["where"] == "local" for r in placed) == local
    fast: HardwareProfile = linear_profile(per_token=1e-5, base=1e-4)  # prefill groups 1000x faster per token
    fast.dump(tmp_path / "fast.json")
    spec = PlacementSpec(mode=PrefillPlacement.AUTO, profile=same, prefill_profile=tmp_path / "fast.json", overhead_s=0)
    out, counts = _run(tiny_engine_dir, spec)
    assert out == plain and counts == (0, 4)  # remote is cheaper even for an idle decode engine


def _beside_a_stream(
    tiny_engine_dir, spec: PlacementSpec, trace: Path, short: dict[str, list[int]]
) -> tuple[list[list[int]], dict[str, tuple[str, int]]]:
    """A long stream decoding, the short prompts sent one after another beside it (no queue here): their tokens,
    and each request's (where it was placed, how many streams were decoding then) from the trace."""
    tracer = Tracer(trace, "decode0")
    c = cluster(tiny_engine_dir, placement=spec, tracer=tracer)
    try:
        c.submit("long", prompt_of(3, 39), SamplingParams(max_tokens=300, ignore_eos=True))
        wait_for(lambda: c.decode.load().decoding == 1, what="the long stream decoding")
        outs = {rid: c.run({rid: p})[rid] for rid, p in short.items()}
        wait_for(lambda: "long" in c.done, what="the long stream")
        assert c.done["long"].error is None and all(o.error is None for o in outs.values())
        wait_for(c.settled, what="every page back")
        for rid in [*short, "long"]:
            tracer.finish(rid)
    finally:
        c.stop()
    placed = {
        str(r["request_id"]): (str(r["where"]), int(str(r["decoding"]))) for r in read_trace(trace) if "where" in r
    }
    return [outs[r].output_ids for r in short], placed


def test_an_itl_budget_keeps_prompts_here_only_while_nothing_decodes(tiny_engine_dir, tmp_path: Path) -> None:
    """One stream decodes; prompts of 3-4 tokens arrive beside it, one after another. Both roles on the same curves
    (0.01 s a prompt token): for them the cost rule says here (its one stall of ~0.03 s is cheaper than the round
    trip). Under an ITL budget below their step they go to a prefill group; the long stream's own prompt, to an idle
    engine, stays here either way."""
    same = tmp_path / "same.json"
    linear_profile(per_token=0.01).dump(same)
    short = {f"s{i}": prompt_of(3 + i % 2, 40 + i) for i in range(3)}
    plain = tiny_engine(tiny_engine_dir("llama")).generate(list(short.values()), GREEDY)
    placed = {}
    for budget in (None, 0.02):  # 20 ms: under a step with a 3-token prompt in it (0.032 s on these curves)
        spec = PlacementSpec(mode=PrefillPlacement.AUTO, profile=same, itl_budget_s=budget)
        out, placed[budget] = _beside_a_stream(tiny_engine_dir, spec, tmp_path / f"trace-{budget}.jsonl", short)
        assert out == plain
    assert placed[None]["long"] == placed[0.02]["long"] == ("local", 0)  # idle: kept here under the budget too
    busy = {b: [w for rid, (w, n) in p.items() if rid in short and n > 0] for b, p in placed.items()}
    assert len(busy[None]) == len(busy[0.02]) == 3  # each short prompt met the long stream decoding
    assert busy[None] == ["local"] * 3 and busy[0.02] == ["remote"] * 3


def test_engine_load_reports_what_the_placement_rule_reads(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"), chunk=8, budget=8)
    a = engine.add_request(prompt_of(6, 1), GREEDY)
    engine.step()  # a: prefilled, first token out
    engine.add_request(prompt_of(20, 2), GREEDY)  # b: 20 prompt tokens to compute, 8 per step
    load = engine.load()
    assert (load.decoding, load.prefill_tokens, load.chunk) == (1, 20, 8)
    assert load.mean_context == len(engine.request(a).all_tokens)
    engine.step()  # b's first chunk rides beside a's decode: 7 tokens (a's token takes one of the 8)
    assert engine.load().prefill_tokens == 13 and engine.load().decoding == 1


def test_auto_placement_serves_locally_while_every_prefill_group_is_down(tiny_engine_dir, tmp_path: Path) -> None:
    fast = tmp_path / "fast.json"
    linear_profile(per_token=1e-5, base=1e-4).dump(fast)  # remote would win while a group is up
    slow = tmp_path / "slow.json"
    linear_profile(per_token=0.01).dump(slow)
    spec = PlacementSpec(mode=PrefillPlacement.AUTO, profile=slow, prefill_profile=fast, overhead_s=0)
    c = cluster(tiny_engine_dir, placement=spec)
    try:
        ScriptedCaller.mode = {0: "down", 1: "down"}
        first = c.run({"a": prompt_of(9, 5)})["a"]  # sent away: both calls fail, both groups cool down
        assert first.error is not None and "no prefill group" in first.error
        second = c.run({"b": prompt_of(9, 6)})["b"]  # nobody in rotation: prefilled here
        assert (
            second.error is None
            and second.output_ids == tiny_engine(tiny_engine_dir("llama")).generate([prompt_of(9, 6)], GREEDY)[0]
        )
        assert c.fetcher.prefill_counts() == (1, 1)
        wait_for(c.settled, what="every page back")
    finally:
        ScriptedCaller.mode = {}
        c.stop()

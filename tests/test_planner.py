"""The planner (``planner/``): cost curves, the placement rule, the simulator against hand-computed
timelines, model shapes against Hugging Face's own parameter counts, GPU rooflines, ``disagg plan``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from disagg.cli import main
from planner.gpus import GPUS, DoesNotFit, roofline_profile
from planner.model_shape import ModelShape
from planner.placement import PlacementInputs, PlacementSpec, PrefillPlacement, decide
from planner.profile import CostModel, DecodeGrid, HardwareProfile
from planner.search import goodput, simulate
from planner.simulator import Deployment, Handover, Mode, Role, Simulator
from planner.workload import SLO, Lengths, Workload
from tests.helpers import linear_profile

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "planner"


def test_cost_curves_interpolate_and_extrapolate_linearly() -> None:
    c = CostModel(linear_profile())
    assert c.prefill_s(128) == pytest.approx(0.01 + 0.128)
    assert c.prefill_s(2048) == pytest.approx(0.01 + 2.048)  # beyond the last point, on the same line
    assert c.decode_s(8, 512) == pytest.approx(0.01 + 8 * 0.002 + 8 * 512 * 1e-6)
    assert c.decode_s(0, 100) == 0.0
    # a mixed step reads the weights once: the decode step plus the prefill above a one-token step
    assert c.step_s(4, 64, 100) == pytest.approx(c.decode_s(4, 64) + c.prefill_s(100) - c.prefill_s(1))
    assert c.transfer_s(1000) == pytest.approx(1000 * 1000 / 1e9)


def test_profiles_are_validated_and_round_trip(tmp_path: Path) -> None:
    p = linear_profile()
    p.dump(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == p
    raw = json.loads((tmp_path / "p.json").read_text())
    raw["version"] = 99
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="profile version 99"):
        HardwareProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="batches x contexts"):
        DecodeGrid(batches=[1, 2], contexts=[64], seconds=[[0.1]])
    with pytest.raises(ValueError, match="needs a hardware profile"):
        PlacementSpec(mode=PrefillPlacement.AUTO)


def test_the_placement_rule_keeps_short_prompts_of_an_idle_engine_and_sends_the_rest() -> None:
    c = CostModel(linear_profile())

    def where(prompt: int, running: int, remote_queue: int = 0, overhead: float = 0.02) -> bool:
        x = PlacementInputs(prompt, running, 256.0, 0, remote_queue, 128)
        return decide(x, c, c, overhead, PrefillPlacement.AUTO).local

    assert where(32, running=0)  # idle: the round trip is pure loss
    assert not where(512, running=8)  # busy: a long prompt would stall eight streams
    assert where(512, running=8, remote_queue=20_000)  # unless the prefill pool is far behind
    d = decide(PlacementInputs(100, 4, 256.0, 0, 0, 128), c, c, 0.02, PrefillPlacement.AUTO)
    assert d.stall_s == pytest.approx(c.prefill_s(100) - c.prefill_s(1))  # one chunk's extra time
    assert d.local == (d.local_s + 4 * d.stall_s <= d.remote_s)
    for mode, local in ((PrefillPlacement.LOCAL, True), (PrefillPlacement.REMOTE, False)):
        assert decide(PlacementInputs(512, 8, 256.0, 0, 0, 128), c, c, 0.02, mode).local is local


def test_an_itl_budget_keeps_prompts_local_only_in_steps_within_it() -> None:
    c = CostModel(linear_profile())
    x = PlacementInputs(100, 4, 256.0, 0, 20_000, 128)  # the prefill pool far behind: the cost rule says local
    assert decide(x, c, c, 0.02, PrefillPlacement.AUTO).local
    step = c.step_s(4, 256.0, 100)  # its one chunk step with the four streams in it
    assert not decide(x, c, c, 0.02, PrefillPlacement.AUTO, itl_budget_s=0.99 * step).local
    assert decide(x, c, c, 0.02, PrefillPlacement.AUTO, itl_budget_s=1.01 * step).local
    long = PlacementInputs(1000, 4, 256.0, 0, 200_000, 128)  # chunked: its longest step is a full chunk's
    assert decide(long, c, c, 0.02, PrefillPlacement.AUTO, itl_budget_s=1.01 * c.step_s(4, 256.0, 128)).local
    assert not decide(long, c, c, 0.02, PrefillPlacement.AUTO, itl_budget_s=0.99 * c.step_s(4, 256.0, 128)).local
    idle = PlacementInputs(32, 0, 0.0, 0, 0, 128)  # nobody decoding: nobody stalls, the budget does not apply
    assert decide(idle, c, c, 0.02, PrefillPlacement.AUTO, itl_budget_s=1e-6).local
    queued = PlacementInputs(32, 0, 0.0, 32, 20_000, 128)  # a prompt queued here decodes by the time this one runs
    assert decide(queued, c, c, 0.02, PrefillPlacement.AUTO).local
    assert not decide(queued, c, c, 0.02, PrefillPlacement.AUTO, itl_budget_s=1e-6).local
    forced = PlacementInputs(512, 8, 256.0, 0, 0, 128)
    assert decide(forced, c, c, 0.02, PrefillPlacement.LOCAL, itl_budget_s=1e-6).local  # only auto reads it
    with pytest.raises(ValueError, match="greater than 0"):
        PlacementSpec(itl_budget_s=0)


def test_the_simulated_decode_node_takes_no_stalling_prompt_under_a_budget() -> None:
    c = CostModel(linear_profile())
    wl = Workload.sampled("w", Lengths.parse("64-256"), Lengths.parse("40-80"), 120)
    arrivals = wl.arrivals(6.0)
    runs = {}
    for budget in (None, 0.02):
        dep = Deployment(
            Mode.DISAGGREGATED, Role(c, 1, 128), Role(c, 1, 128), PrefillPlacement.AUTO, itl_budget_s=budget
        )
        runs[budget] = Simulator(dep).run(wl.requests, arrivals, 6.0, 200.0)
    free, bounded = runs[None], runs[0.02]
    assert 0 < bounded.local_share < free.local_share  # idle moments still keep prompts at home
    worst = [r.pct("tpot", 100) for r in (free, bounded)]
    assert worst[0] is not None and worst[1] is not None and worst[1] < worst[0]


def test_one_request_alone_follows_the_hand_computed_timeline() -> None:
    c = CostModel(linear_profile())
    prompt, out = 100, 5
    col = Simulator(Deployment(Mode.COLOCATED, Role(c, 1, 512))).run([(prompt, out)], [0.0], 1.0, 100.0)
    r = col.requests[0]
    assert r.ttft == pytest.approx(c.prefill_s(prompt))
    steps = [c.decode_s(1, prompt + k) for k in range(1, out)]  # tokens 2..5, each one decode step
    assert r.tpot == pytest.approx(sum(steps) / (out - 1))
    # disaggregated: the prefill computes all but the last token, the KV crosses (exposed share),
    # the round trip, then the decode's first step runs the last prompt token
    dep = Deployment(Mode.DISAGGREGATED, Role(c, 1, 512), Role(c, 1, 512), overhead_s=0.03, exposed_share=0.5)
    dis = Simulator(dep).run([(prompt, out)], [0.0], 1.0, 100.0).requests[0]
    landed = c.prefill_s(prompt - 1) + 0.5 * c.transfer_s(prompt - 1) + 0.03
    assert dis.ttft == pytest.approx(landed + c.decode_s(1, prompt))
    assert dis.transfer == pytest.approx(landed - c.prefill_s(prompt - 1))
    assert dis.handover == pytest.approx(c.decode_s(1, prompt))
    # the Dynamo-style handover: the prefill's own token ends TTFT
    tok = Simulator(Deployment(Mode.DISAGGREGATED, Role(c, 1, 512), Role(c, 1, 512), overhead_s=0.03,
                               handover=Handover.PREFILL_TOKEN)).run([(prompt, out)], [0.0], 1.0, 100.0)  # fmt: skip
    assert tok.requests[0].ttft == pytest.approx(c.prefill_s(prompt) + 0.015)


def test_chunked_prefill_stalls_running_streams_and_disaggregation_does_not() -> None:
    c = CostModel(linear_profile())
    reqs, arrivals = [(16, 50), (1000, 2)], [0.0, 0.1]
    col = Simulator(Deployment(Mode.COLOCATED, Role(c, 1, 128))).run(reqs, arrivals, 1.0, 100.0)
    dis_dep = Deployment(Mode.DISAGGREGATED, Role(c, 1, 128), Role(c, 1, 128))
    dis = Simulator(dis_dep).run(reqs, arrivals, 1.0, 100.0)
    alone = Simulator(Deployment(Mode.COLOCATED, Role(c, 1, 128))).run(reqs[:1], arrivals[:1], 1.0, 100.0)
    stream = [r.requests[0].tpot for r in (col, dis, alone)]
    assert stream[0] is not None and stream[1] is not None and stream[2] is not None
    assert stream[0] > 1.5 * stream[2]  # eight 128-token chunks ride in its steps
    assert stream[1] < 1.1 * stream[2] + 1e-3  # the long prompt went to the prefill engine


def test_kv_room_makes_requests_wait_and_overload_misses_slos() -> None:
    c = CostModel(linear_profile().model_copy(update={"max_batch_tokens": 300}))
    dep = Deployment(Mode.COLOCATED, Role(c, 1, 512))
    res = Simulator(dep).run([(100, 100), (100, 100)], [0.0, 0.0], 1.0, 100.0)
    a, b = res.requests
    assert a.ttft is not None and b.ttft is not None and b.ttft > a.ttft + 99 * 0.01  # waited for a's KV to go
    wl = Workload.sampled("w", Lengths.parse("64-128"), Lengths.parse("20"), 200)
    slo = SLO(1.0, 0.05)
    cm = CostModel(linear_profile())
    dep = Deployment(Mode.COLOCATED, Role(cm, 1, 256))
    light, heavy = simulate(dep, wl, 0.5), simulate(dep, wl, 50.0)
    assert light.attainment(slo) > 0.95 and heavy.attainment(slo) < 0.5
    g, at = goodput(dep, wl, slo)
    assert at is not None and at.attainment(slo) >= 0.9
    assert simulate(dep, wl, g * 1.5).attainment(slo) < 0.9 or g * 1.5 < 0.5  # the search stops near the edge
    unfinished = Simulator(dep).run(wl.requests, wl.arrivals(50.0), 50.0, 1.0)  # bounded: the rest are misses
    assert any(r.ttft is None for r in unfinished.requests)


def test_lengths_and_request_files(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    assert Lengths.parse("7").sample(rng) == 7
    assert all(3 <= Lengths.parse("3-9").sample(rng) <= 9 for _ in range(50))
    xs = sorted(Lengths.parse("lognormal:100:0.5").sample(rng) for _ in range(2001))
    assert 85 <= xs[1000] <= 115  # the median
    with pytest.raises(ValueError, match="lognormal:MEDIAN:SIGMA"):
        Lengths.parse("9-3")
    f = tmp_path / "requests-x.jsonl"
    f.write_text('{"prompt": "a", "prompt_tokens": 12, "max_tokens": 7}\n', encoding="utf-8")
    assert Workload.from_file(f).requests == [(12, 7)] and Workload.from_file(f).name == "x"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3"])
def test_model_shape_counts_the_parameters_hugging_face_has(
    kind: str, tiny: Callable[[str], tuple[Path, torch.nn.Module]]
) -> None:
    folder, model = tiny(kind)
    shape = ModelShape.load(folder)
    counted = sum(
        p.numel() for n, p in model.named_parameters()
        if "norm" not in n and not n.endswith("bias") and not n.endswith("mlp.gate.weight")  # norms, biases, routers
    )  # fmt: skip
    assert shape.total_params == counted
    assert shape.params_read(1) == pytest.approx(shape.active_params)  # one token: its k experts
    if shape.moe_layers:
        assert shape.params_read(10_000) == pytest.approx(shape.total_params, rel=1e-6)  # all experts


def test_published_models_and_gpu_rooflines() -> None:
    r1 = ModelShape.load(CONFIGS / "deepseek-r1.json")
    assert r1.total_params / 1e9 == pytest.approx(671, rel=0.01)
    assert r1.active_params / 1e9 == pytest.approx(37, rel=0.02)
    llama = ModelShape.load(CONFIGS / "llama-3.1-70b.json")
    assert llama.total_params / 1e9 == pytest.approx(70.6, rel=0.01)
    with pytest.raises(DoesNotFit, match="8 x H100"):
        roofline_profile(r1, GPUS["H100"], 8)  # 671 GB of FP8 weights in 640 GB
    h200 = CostModel(roofline_profile(r1, GPUS["H200"], 8))
    # MoE: one sequence reads its 8 experts per layer, 256 sequences read nearly all 256
    assert h200.decode_s(256, 4096) > 4 * h200.decode_s(1, 4096)
    assert h200.prefill_s(16384) > 10 * h200.prefill_s(1024) / 2  # compute-bound: grows with tokens
    l40s, h100 = (CostModel(roofline_profile(llama, GPUS[g], 4)) for g in ("L40S", "H100"))
    assert h100.decode_s(64, 2048) < 1.5 * h100.decode_s(1, 2048)  # dense, memory-bound: batching nearly free
    assert l40s.decode_s(32, 2048) > 2 * h100.decode_s(32, 2048)  # a quarter of the bandwidth


def test_disagg_plan_writes_plans_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    linear_profile().dump(tmp_path / "p.json")
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--devices", "3", "--input", "64-256", "--output", "20",
            "--requests", "60", "--ttft-slo", "1", "--tpot-slo", "0.05", "--chunk", "128", "--rate", "1",
            "--json", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png")]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    labels = {p["label"] for p in doc["plans"]}
    assert "colocated 3 x tp1" in labels and "disaggregated 1P x tp1 : 2D x tp1" in labels
    assert "disaggregated 2P x tp1 : 1D x tp1, conditional" in labels
    assert all(p["goodput"] >= 0 for p in doc["plans"]) and (tmp_path / "plan.png").stat().st_size > 0
    assert len(doc["at_rate"]) == len(doc["plans"]) and "| plan | devices |" in capsys.readouterr().out
    batches = ["plan", "--profile", str(tmp_path / "p.json"), "--devices", "2", "--input", "64", "--output", "20",
               "--requests", "40", "--max-seqs", "1", "16", "--json", str(tmp_path / "b.json")]  # fmt: skip
    assert main(batches) == 0
    plans = {p["label"]: p for p in json.loads((tmp_path / "b.json").read_text())["plans"]}
    assert {"colocated 2 x tp1, batch <= 1", "colocated 2 x tp1, batch <= 16"} <= set(plans)
    assert plans["colocated 2 x tp1, batch <= 16"]["goodput"] > plans["colocated 2 x tp1, batch <= 1"]["goodput"]
    assert main(["plan", "--devices", "2"]) == 2  # no hardware: a clear error, not a trace
    assert "no hardware for the decode role" in capsys.readouterr().err
    assert main(["plan", "--gpu", "H100", "--devices", "8"]) == 2
    assert "needs --model" in capsys.readouterr().err


def test_heterogeneous_roles_are_planned_with_their_own_curves(tmp_path: Path) -> None:
    model = str(CONFIGS / "llama-3.1-70b.json")
    args = ["plan", "--model", model, "--prefill-gpu", "H100", "--decode-gpu", "L40S", "--devices", "8",
            "--tp", "2", "4", "--input", "2000", "--output", "200", "--requests", "60", "--ttft-slo", "2",
            "--tpot-slo", "0.1", "--handover", "prefill-token", "--json", str(tmp_path / "h.json")]  # fmt: skip
    assert main(args) == 0
    plans = json.loads((tmp_path / "h.json").read_text())["plans"]
    labels = [p["label"] for p in plans]
    assert any("(H100)" in x for x in labels) and any("(L40S)" in x for x in labels)
    assert any(x.startswith("disaggregated") for x in labels)
    assert all(math.isfinite(p["goodput"]) for p in plans)


def test_validation_re_simulates_every_point_of_a_bench_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``disagg plan --validate``: the benchmark's own profile, requests, arrivals and settings."""
    (tmp_path / "requests-prefill-heavy.jsonl").write_text(
        "\n".join(json.dumps({"prompt": "x", "prompt_tokens": 100 + i, "max_tokens": 20}) for i in range(10)) + "\n"
    )
    point = {"workload": "prefill-heavy", "rate": 0.5, "requests": 10, "slo_attainment": 1.0, "ttft_p50": 0.2,
             "ttft_p99": 0.3, "tpot_p50": 0.02, "tpot_p99": 0.03, "local_prefills": 4}  # fmt: skip
    bench = {
        "command": "disagg bench serve --requests 10 --chunk 64 --max-seconds 100 --placement remote",
        "calibration": {"profile": linear_profile().model_dump(mode="json")},
        "workloads": {"prefill-heavy": {"slo": {"ttft_s": 1.0, "tpot_s": 0.05}, "rates": [0.5],
                                        "goodput": {"colocated": 0.5, "disaggregated": 0.0}}},
        "points": [point | {"mode": "colocated"}, point | {"mode": "disaggregated"}],
    }  # fmt: skip
    (tmp_path / "bench_serve.json").write_text(json.dumps(bench))
    assert main(["plan", "--validate", str(tmp_path / "bench_serve.json"), "--json", str(tmp_path / "v.json")]) == 0
    doc = json.loads((tmp_path / "v.json").read_text())
    assert [(p["mode"], p["rate"]) for p in doc["points"]] == [("colocated", 0.5), ("disaggregated", 0.5)]
    dis = doc["points"][1]
    assert dis["local_share"] == {"predicted": 0.0, "measured": 0.4}  # placement remote, as the run said
    assert dis["ttft_p50"]["measured"] == 0.2 and dis["ttft_p50"]["predicted"] > 0
    assert doc["goodput"]["prefill-heavy"]["colocated"]["measured"] == 0.5
    assert "| prefill-heavy | 0.5 | colocated |" in capsys.readouterr().out
    bench["calibration"] = {}
    (tmp_path / "old.json").write_text(json.dumps(bench))
    assert main(["plan", "--validate", str(tmp_path / "old.json")]) == 2  # a run without a profile: said, not a trace

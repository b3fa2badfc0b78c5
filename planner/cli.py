"""``disagg plan``: colocated vs disaggregated plans for a model, hardware, a workload and SLOs.

    disagg plan --profile runs/profile.json --input 128 --output 64-128 --ttft-slo 0.6 --tpot-slo 0.026 --devices 4
    disagg plan --model configs/planner/deepseek-r1.json --gpu H200 --devices 32 --tp 8 16 24 \\
        --input lognormal:4000:0.6 --output 300-700 --ttft-slo 2 --tpot-slo 0.02 --handover prefill-token
    disagg plan --model M --prefill-gpu H100 --decode-gpu L40S ...           # heterogeneous roles
    disagg plan --validate runs/bench_serve/bench_serve.json                   # against a measured benchmark
                                                   (``bench/serve/validate.py``; ``disagg/cli.py`` wires it)

Hardware: a measured profile (``disagg bench engine --profile``) or a named GPU (``planner/gpus.py``),
per role where they differ. A device is one profile instance's unit (a GPU, or a 1-thread core).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from planner.gpus import GPUS, DoesNotFit, GpuSpec, Precision, roofline_profile
from planner.model_shape import ModelShape
from planner.placement import PrefillPlacement
from planner.profile import CostModel, HardwareProfile
from planner.report import ms, row, table
from planner.search import Evaluated, search, simulate
from planner.simulator import Deployment, Handover, Mode, Role
from planner.workload import SLO, Lengths, Workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    hw = p.add_argument_group("hardware (a measured profile, or a named GPU; per role when they differ)")
    hw.add_argument("--profile", type=Path, help="measured profile (disagg bench engine --profile)")
    hw.add_argument("--gpu", choices=sorted(GPUS), help="a GPU from published figures (needs --model)")
    hw.add_argument("--prefill-profile", type=Path)
    hw.add_argument("--prefill-gpu", choices=sorted(GPUS))
    hw.add_argument("--decode-profile", type=Path)
    hw.add_argument("--decode-gpu", choices=sorted(GPUS))
    hw.add_argument("--model", help="engine directory or Hugging Face config.json (GPU profiles)")
    hw.add_argument("--weight-bytes", type=float, default=Precision().weight_bytes, help="GPU profiles: 1 = FP8")
    p.add_argument("--devices", type=int, default=2, help="device budget of a plan (GPUs, or 1-thread cores)")
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="devices per instance to consider, per role")
    wl = p.add_argument_group("workload")
    wl.add_argument("--requests-file", type=Path, help="a serving benchmark's requests-<workload>.jsonl")
    wl.add_argument("--input", default="128", help="prompt lengths: N, A-B, lognormal:MEDIAN:SIGMA")
    wl.add_argument("--output", default="64-128", help="output lengths, same forms")
    wl.add_argument("--requests", type=int, default=300, help="simulated requests per rate")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token")
    p.add_argument("--rate", type=float, default=None, help="also report every plan at this rate (req/s)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per engine step (chunked prefill budget)")
    p.add_argument("--max-seqs", type=int, nargs="+", default=[256],
                   help="batch limits (sequences per step) to consider; several: every plan with each")  # fmt: skip
    p.add_argument("--handover", choices=["decode-step", "prefill-token"], default="decode-step",
                   help="decode-step: this engine (the decode runs the last prompt token); prefill-token: "
                   "the prefill samples the first token (Dynamo, SGLang)")  # fmt: skip
    p.add_argument("--overhead-s", type=float, default=0.02, help="a remote prefill's fixed round trip")
    p.add_argument("--step-overhead-s", type=float, default=0.0,
                   help="a measured profile: what the serving process adds to every step")  # fmt: skip
    p.add_argument("--request-overhead-s", type=float, default=0.0,
                   help="client -> engine time of every request (tokenising, RPCs)")  # fmt: skip
    p.add_argument("--exposed-share", type=float, default=1.0, help="share of the KV transfer not hidden by streaming")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG: goodput per device of every plan")


def _hardware(a: argparse.Namespace, role: str) -> HardwareProfile | GpuSpec:
    profile, gpu = getattr(a, f"{role}_profile") or a.profile, getattr(a, f"{role}_gpu") or a.gpu
    if profile is not None:
        return HardwareProfile.load(profile)
    if gpu is not None:
        if a.model is None:
            raise ValueError("a GPU profile needs --model (an engine directory or a Hugging Face config.json)")
        return GPUS[gpu]
    raise ValueError(f"no hardware for the {role} role: give --profile or --gpu (or --{role}-profile / --{role}-gpu)")


def _costs(a: argparse.Namespace, role: str, tp: int, shape: ModelShape | None) -> CostModel | None:
    hw = _hardware(a, role)
    if isinstance(hw, HardwareProfile):
        return CostModel(hw, a.step_overhead_s) if tp == hw.devices else None  # measured: one instance size
    assert shape is not None
    try:
        return CostModel(roofline_profile(shape, hw, tp, Precision(weight_bytes=a.weight_bytes)))
    except DoesNotFit:
        return None


def candidates(a: argparse.Namespace) -> list[tuple[str, Deployment]]:
    shape = ModelShape.load(a.model) if a.model else None
    handover = Handover.PREFILL_TOKEN if a.handover == "prefill-token" else Handover.DECODE_STEP
    out: list[tuple[str, Deployment]] = []
    hetero = (a.prefill_gpu or a.prefill_profile) is not None or (a.decode_gpu or a.decode_profile) is not None
    roles = ["decode", "prefill"] if hetero else ["decode"]
    for role in roles:  # colocated on each kind of hardware
        name = _hardware(a, role).name
        for tp in a.tp:
            c = _costs(a, role, tp, shape)
            if c is None or tp > a.devices:
                continue
            n = a.devices // tp
            label = f"colocated {n} x tp{tp}" + (f" ({name})" if hetero else "")
            for b in a.max_seqs:
                dep = Deployment(Mode.COLOCATED, Role(c, n, a.chunk, b), request_overhead_s=a.request_overhead_s)
                out.append((label + _batch(a, b), dep))
    for tp_p in a.tp:
        cp = _costs(a, "prefill", tp_p, shape)
        for tp_d in a.tp:
            cd = _costs(a, "decode", tp_d, shape)
            if cp is None or cd is None:
                continue
            for p in range(1, a.devices // tp_p + 1):
                d = (a.devices - p * tp_p) // tp_d
                if d < 1:
                    break
                for placement in (PrefillPlacement.REMOTE, PrefillPlacement.AUTO):
                    for b in a.max_seqs:  # the decode role's batch limit (prefill engines batch by tokens)
                        dep = Deployment(
                            Mode.DISAGGREGATED, Role(cd, d, a.chunk, b), Role(cp, p, a.chunk, max(a.max_seqs)),
                            placement, a.overhead_s, handover, a.exposed_share, a.request_overhead_s,
                            a.tpot_slo if placement is PrefillPlacement.AUTO else None,
                        )  # fmt: skip
                        tag = "" if placement is PrefillPlacement.REMOTE else ", conditional"
                        out.append((f"disaggregated {p}P x tp{tp_p} : {d}D x tp{tp_d}{tag}{_batch(a, b)}", dep))
    return out


def _batch(a: argparse.Namespace, b: int) -> str:
    return f", batch <= {b}" if len(a.max_seqs) > 1 else ""


def workload(a: argparse.Namespace) -> Workload:
    if a.requests_file is not None:
        return Workload.from_file(a.requests_file)
    return Workload.sampled("workload", Lengths.parse(a.input), Lengths.parse(a.output), a.requests)


def run(a: argparse.Namespace) -> int:
    wl, slo = workload(a), SLO(a.ttft_slo, a.tpot_slo)
    cands = candidates(a)
    if not cands:
        raise ValueError("no plan fits: every TP size leaves no room for KV, or exceeds --devices")
    print(
        f"[plan] {len(cands)} plans, {len(wl.requests)} requests per rate (mean input {wl.mean_input:.0f}, "
        f"output {wl.mean_output:.0f} tokens), SLO TTFT <= {a.ttft_slo} s, TPOT <= {1e3 * a.tpot_slo:g} ms"
    )

    def progress(e: Evaluated) -> None:
        print(f"[plan]   {e.label}: {e.goodput:.3f} req/s", flush=True)

    evaluated = search(cands, wl, slo, progress)
    rows = [row(e) for e in evaluated]
    print(table(rows))
    best = {m: next((r for r in rows if r.mode == m), None) for m in ("colocated", "disaggregated")}
    c, d = best["colocated"], best["disaggregated"]
    summary: dict[str, object] = {"best": {k: asdict(v) if v else None for k, v in best.items()}}
    if c is not None and d is not None and c.goodput_per_device > 0:
        ratio = d.goodput_per_device / c.goodput_per_device
        summary["disaggregated_over_colocated_per_device"] = ratio
        print(f"[plan] best disaggregated / best colocated goodput per device: {ratio:.2f}")
    if a.rate is not None:
        at = {}
        for ev in evaluated:  # every plan at the same offered load
            res = simulate(ev.deployment, wl, a.rate)
            at[ev.label] = asdict(row(ev, res))
            tpot = res.pct("tpot", 50)
            speed = f"{1 / tpot:.0f}" if tpot else "-"
            print(
                f"[plan] at {a.rate} req/s, {ev.label}: TTFT p50 {ms(res.pct('ttft', 50))} ms, "
                f"TPOT p50 {ms(tpot)} ms ({speed} tok/s per request), SLO {100 * res.attainment(slo):.0f}%"
            )
        summary["at_rate"] = at
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"workload": {"requests": len(wl.requests), "mean_input": wl.mean_input, "mean_output": wl.mean_output},
               "slo": asdict(slo), "plans": [asdict(r) for r in rows], **summary}  # fmt: skip
        a.json.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    if a.plot is not None:
        from planner.plots import plot_plans

        plot_plans(a.plot, rows)
    return 0

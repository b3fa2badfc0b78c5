"""``disagg bench engine``: engine decode / prefill speed beside HF transformers, and the memory floor.

Everything is measured in one run, same weights, same dtype, same torch threads. For every thread
count (``--threads``, default 1 and 2) and batch size (``--batch``, default 1 2 4 8 16), engine
and HF alternate ``--repeats`` times and each figure is the median:

- prefill tokens/s: one step that prefills ``batch`` prompts of ``prompt_len`` tokens (engine)
  vs one HF forward over the same ``[batch, prompt_len]`` ids;
- decode step and tokens/s: ``decode_tokens`` greedy steps after that prefill (engine) vs HF
  ``generate`` with its KV cache (``decode_tokens + 1`` new tokens minus 1 new token);
- the floor of a decode step at that batch: the bytes one step must read (every weight once,
  tied embeddings once, plus the KV of every sequence's context, in the dtype used) over the
  *read* bandwidth measured in the same run with the same threads (``sum`` over a 512 MiB
  buffer: decode reads weights, it does not copy them);
- the aggregate decode speed-up of each batch over batch 1;
- the optional peer llama.cpp (``make bench-peers`` installs ``llama-cpp-python``, built from
  source): the same GGUF weights requantised to the engine's dtype (F32 or BF16, i.e. the weights
  our builder dequantises), the same threads, a ``prompt_len`` prefill then ``decode_tokens``
  single-token decodes. Batch 1 only: the binding's high-level API decodes one sequence.

The CPU model and its flags and the engine's kernel path (``LLMEngine.kernel_path``) are
recorded with every result.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from bench.bandwidth import copy_bandwidth, read_bandwidth
from bench.peers import PeerPoint, hf_run, llamacpp_points, load_hf
from bench.quality import Quality, measure_quality
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.config import NO_PREFIX_CACHE, DType, EngineConfig, EngineManifest, SchedulerConfig
from torch_engine.cpu import cpu_info
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    engine_source_arguments(p, DType.FLOAT32)
    p.add_argument("--run-dtype", choices=["auto", *(d.value for d in DType)], default="auto",
                   help="dtype the engine runs in (auto: the fastest this CPU computes natively)")  # fmt: skip
    p.add_argument("--kv-dtype", choices=[d.value for d in DType], default=None,
                   help="the KV pages' dtype (default: the compute dtype; bf16 under an fp32 CPU's auto)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3, help="alternating engine / HF runs per point (median)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even where it is installed")
    p.add_argument("--reference", action="store_true", help="the engine's reference path (no packed weights / kernels)")
    p.add_argument("--decode-graphs", choices=["auto", "on", "off"], default="auto",
                   help="decode-only steps through CUDA graphs (auto: on for CUDA)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write every figure and ratio here")
    p.add_argument(
        "--quality",
        type=int,
        nargs="?",
        const=4096,
        default=None,
        metavar="TOKENS",
        help="also: perplexity of the fast path vs the dequantised path on a fixed text, its first TOKENS tokens "
        "(default 4096; bench/quality.py)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="instead: measure a hardware profile for `disagg plan` / placement (first --threads value)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="with --profile: the KV link's rate in GB/s (default: memory copy bandwidth measured here)",
    )


@dataclass(frozen=True, slots=True)
class Options:
    engine_dir: Path
    device: str
    run_dtype: str
    threads: list[int]
    prompt_len: int
    decode_tokens: int
    batch: list[int]
    repeats: int
    hf: bool
    json: Path | None
    decode_graphs: bool | None = None
    llamacpp: bool = True
    reference: bool = False
    quality: int | None = None  # --quality: tokens of the fixed text
    kv_dtype: str | None = None  # --kv-dtype: the KV pages' dtype (None: the engine's, models.run_kv_dtype)


@dataclass(slots=True)
class Point:
    """One (threads, batch) point."""

    engine_prefill_tok_s: float
    engine_decode_tok_s: float
    engine_decode_step_ms: float
    floor_ms: float
    step_over_floor: float
    aggregate_over_batch1: float = 0.0
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None
    hf_decode_step_ms: float | None = None
    hf_step_over_floor: float | None = None
    hf_aggregate_over_batch1: float | None = None
    decode_over_hf: float | None = None


@dataclass(slots=True)
class ThreadReport:
    threads: int
    read_GBps: float
    copy_GBps: float
    points: dict[int, Point] = field(default_factory=dict)
    llamacpp: list[PeerPoint] = field(default_factory=list)  # the file as stored first


@dataclass(slots=True)
class Report:
    model: str
    dtype: str
    kv_dtype: str
    kernel_path: str
    cpu: dict[str, object]
    prompt_len: int
    decode_tokens: int
    repeats: int
    weight_bytes: int
    kv_bytes_per_token: int
    by_threads: dict[int, ThreadReport] = field(default_factory=dict)
    goals: dict[str, bool] = field(default_factory=dict)
    quality: Quality | None = None  # --quality: perplexity of the fast path vs the reference path


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def engine_run(engine: LLMEngine, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one batch: the first step prefills every prompt."""
    params = SamplingParams(max_tokens=decode_tokens + 1, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    assert steps == decode_tokens, f"expected {decode_tokens} decode steps, ran {steps}"
    for rid in ids:
        engine.retire(rid)
    return t1 - t0, t2 - t1


def decode_step_ms(engine: LLMEngine, batch: int) -> float:
    """Mean decode-step milliseconds of ``batch`` requests of 256 random prompt tokens (seeded by the batch),
    32 decode steps each, counted from the step after every request has its first token (prefill chunked
    over steps as the engine's budget allows)."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    ids = [engine.add_request(torch.randint(100, 40000, (256,), generator=g).tolist(), params) for _ in range(batch)]
    while not all(engine.request(i).output_ids for i in ids):
        engine.step()
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        n += 1
    for i in ids:
        engine.retire(i)
    return (time.perf_counter() - t0) / n * 1000


def run(a: argparse.Namespace) -> int:
    if a.profile is not None:
        return run_profile(a)
    opts = Options(
        engine_dir_of(a), a.device, a.run_dtype, a.threads, a.prompt_len, a.decode_tokens, a.batch, a.repeats,
        not a.no_hf, a.json, {"auto": None, "on": True, "off": False}[a.decode_graphs], not a.no_llamacpp, a.reference,
        a.quality, a.kv_dtype,
    )  # fmt: skip
    report = measure(opts)
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return 0


def run_profile(a: argparse.Namespace) -> int:
    from bench.profile import measure_profile

    link = a.link_gbps * 1e9 if a.link_gbps else copy_bandwidth(device=a.device)
    dtype: DType | Literal["auto"] = "auto" if a.run_dtype == "auto" else DType(a.run_dtype)
    print(f"[bench] measuring a hardware profile ({a.threads[0]} thread(s))", flush=True)
    profile = measure_profile(engine_dir_of(a), a.threads[0], dtype, link, device=a.device, fast_cpu=not a.reference)
    profile.dump(a.profile)
    print(f"[bench] {profile.name}; kernel path {profile.device['kernel_path']}", flush=True)
    for n, s in profile.prefill:
        print(f"[bench] prefill {n:5d} tokens: {1e3 * s:8.1f} ms", flush=True)
    for b, row in zip(profile.decode.batches, profile.decode.seconds, strict=True):
        cells = "  ".join(f"ctx {c}: {1e3 * s:6.1f} ms" for c, s in zip(profile.decode.contexts, row, strict=True))
        print(f"[bench] decode batch {b:3d}: {cells}", flush=True)
    print(f"[bench] wrote {a.profile}", flush=True)
    return 0


def _engine(opts: Options) -> LLMEngine:
    max_batch = max(opts.batch)
    page = EngineManifest.load(opts.engine_dir).page_size
    cfg = EngineConfig(
        engine_dir=opts.engine_dir,
        device=opts.device,
        decode_graphs=opts.decode_graphs,
        fast_cpu=not opts.reference,
        dtype="auto" if opts.run_dtype == "auto" else DType(opts.run_dtype),
        kv_dtype=DType(opts.kv_dtype) if opts.kv_dtype else None,
        num_pages=max_batch * (-(-(opts.prompt_len + opts.decode_tokens + 2) // page)) + 8,
        scheduler=SchedulerConfig(
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_batch * opts.prompt_len,
            max_prefill_chunk=opts.prompt_len,
        ),
        prefix_cache=NO_PREFIX_CACHE,  # repeats replay the same prompt: they must prefill it, not reuse it
    )
    return LLMEngine(cfg, load_tokenizer=False)


def measure(opts: Options) -> Report:
    engine = _engine(opts)
    info = engine.describe()
    hf = load_hf(opts.engine_dir, info.dtype, opts.device) if opts.hf else None
    mc = info.model
    report = Report(
        info.source, str(info.dtype).removeprefix("torch."), str(info.kv_dtype).removeprefix("torch."),
        info.kernel_path, _device_info(opts.device),
        opts.prompt_len, opts.decode_tokens, opts.repeats, info.weight_bytes, info.kv_bytes_per_token,
    )  # fmt: skip
    print(f"[bench] {cpu_info().label}; dtype {report.dtype}; KV pages {report.kv_dtype}; "
          f"kernel path {report.kernel_path}", flush=True)  # fmt: skip
    context = opts.prompt_len + opts.decode_tokens // 2  # mean context over the decode steps
    for threads in opts.threads:
        torch.set_num_threads(threads)
        read, copy = read_bandwidth(device=opts.device), copy_bandwidth(device=opts.device)
        tr = report.by_threads[threads] = ThreadReport(threads, read / 1e9, copy / 1e9)
        engine_run(engine, _prompts(1, opts.prompt_len, mc.vocab_size, 99), 2)  # warm-up
        if hf is not None:
            hf_run(hf, _prompts(1, opts.prompt_len, mc.vocab_size, 99), 2)
        for batch in opts.batch:
            floor_ms = 1e3 * (info.weight_bytes + info.kv_bytes_per_token * context * batch) / (tr.read_GBps * 1e9)
            tr.points[batch] = _point(engine, hf, opts, batch, floor_ms)
            if 1 in tr.points:
                p, one = tr.points[batch], tr.points[1]
                p.aggregate_over_batch1 = p.engine_decode_tok_s / one.engine_decode_tok_s
                if p.hf_decode_tok_s is not None and one.hf_decode_tok_s is not None:
                    p.hf_aggregate_over_batch1 = p.hf_decode_tok_s / one.hf_decode_tok_s
            print(_line(threads, batch, tr.points[batch]), flush=True)
        if opts.llamacpp and opts.device == "cpu" and 1 in tr.points:
            prompt = _prompts(1, opts.prompt_len, mc.vocab_size, 1)[0]
            one = tr.points[1]
            peers = llamacpp_points(
                info, opts.engine_dir, prompt, opts.decode_tokens, opts.repeats, threads, opts.batch
            )
            tr.llamacpp = [
                replace(
                    peer,
                    engine_decode_over_peer=one.engine_decode_tok_s / peer.decode_tok_s,
                    step_over_floor=peer.decode_step_ms / one.floor_ms,
                )
                for peer in peers
            ]
            for peer in tr.llamacpp:
                ratios = [f"batch 1 x{peer.engine_decode_over_peer:.2f}"] + [
                    f"batch {b} x{tr.points[b].engine_decode_tok_s / t:.2f}"
                    for b, t in peer.batched_decode_tok_s.items()
                    if b in tr.points
                ]
                print(f"threads {threads} engine / llama.cpp ({peer.weights}): {', '.join(ratios)}", flush=True)
    if opts.quality and not opts.reference and opts.device == "cpu":
        report.quality = _quality(opts, opts.quality)
    report.goals = goals(report)
    print("goals: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report.goals.items()))
    return report


def _quality(opts: Options, tokens: int) -> Quality:
    q = measure_quality(opts.engine_dir, "auto" if opts.run_dtype == "auto" else DType(opts.run_dtype), tokens)
    print(
        f"[bench] quality on {q.tokens} tokens ({q.dtype}): perplexity {q.ppl_dequantised:.3f} dequantised path "
        f"({q.ppl_fp32:.3f} in fp32), {q.ppl_decode:.3f} decode path (x{q.decode_over_dequantised:.4f}), "
        f"{q.ppl_prefill:.3f} 16-token prefill (x{q.prefill_over_dequantised:.4f}); top token as the dequantised "
        f"path's at {100 * q.top1_agreement:.1f}%",
        flush=True,
    )
    return q


def _device_info(device: str) -> dict[str, object]:
    info = cpu_info().as_dict()
    if device != "cpu":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _point(engine: LLMEngine, hf: torch.nn.Module | None, opts: Options, batch: int, floor_ms: float) -> Point:
    prompts = _prompts(batch, opts.prompt_len, engine.describe().model.vocab_size, batch)
    e_runs, h_runs = [], []
    for _ in range(opts.repeats):
        e_runs.append(engine_run(engine, prompts, opts.decode_tokens))
        if hf is not None:
            h_runs.append(hf_run(hf, prompts, opts.decode_tokens))
    e_pre, e_dec = (statistics.median(r[i] for r in e_runs) for i in (0, 1))
    step_ms = 1e3 * e_dec / opts.decode_tokens
    point = Point(
        engine_prefill_tok_s=batch * opts.prompt_len / e_pre,
        engine_decode_tok_s=batch * opts.decode_tokens / e_dec,
        engine_decode_step_ms=step_ms,
        floor_ms=floor_ms,
        step_over_floor=step_ms / floor_ms,
    )
    if h_runs:
        h_pre, h_dec = (statistics.median(r[i] for r in h_runs) for i in (0, 1))
        point.hf_prefill_tok_s = batch * opts.prompt_len / h_pre
        point.hf_decode_tok_s = batch * opts.decode_tokens / h_dec
        point.decode_over_hf = point.engine_decode_tok_s / point.hf_decode_tok_s
        point.hf_decode_step_ms = 1e3 * h_dec / opts.decode_tokens
        point.hf_step_over_floor = point.hf_decode_step_ms / floor_ms
    return point


def _line(threads: int, batch: int, p: Point) -> str:
    hf = f" (HF {p.hf_decode_tok_s:6.1f}, x{p.decode_over_hf:.2f})" if p.decode_over_hf is not None else ""
    return (
        f"threads {threads} batch {batch:>3}: prefill {p.engine_prefill_tok_s:7.0f} tok/s  decode "
        f"{p.engine_decode_tok_s:7.1f} tok/s{hf}  step {p.engine_decode_step_ms:6.1f} ms = "
        f"x{p.step_over_floor:.2f} floor ({p.floor_ms:.1f} ms)  aggregate x{p.aggregate_over_batch1:.1f}"
    )


def goals(report: Report) -> dict[str, bool]:
    """The engine-speed issue's goals that this run can judge."""
    out: dict[str, bool] = {}
    one = report.by_threads.get(1)
    flags = report.cpu.get("flags", [])
    amx = isinstance(flags, list) and any(str(f).startswith("amx") for f in flags)
    limit = 1.3 if amx else 1.5  # batch-8 step / batch-1 step at one thread: AMX CPUs / the others
    if one is not None and 1 in one.points and 8 in one.points:
        ratio = one.points[8].engine_decode_step_ms / one.points[1].engine_decode_step_ms
        out[f"batch8_over_batch1_step_at_most_{limit}_one_thread"] = ratio <= limit
    for tr in report.by_threads.values():
        pts = tr.points
        if 1 in pts:
            out[f"batch1_within_1.3x_floor_{tr.threads}t"] = pts[1].step_over_floor <= 1.3
        for b in (1, 16):
            if b in pts and pts[b].decode_over_hf is not None:
                out[f"batch{b}_decode_at_least_1.5x_hf_{tr.threads}t"] = (pts[b].decode_over_hf or 0) >= 1.5
        if tr.llamacpp:  # the goals are against llama.cpp on the same file, as stored
            peer = tr.llamacpp[0]
            out[f"batch1_decode_at_least_1.2x_llamacpp_same_file_{tr.threads}t"] = peer.engine_decode_over_peer >= 1.2
            if 16 in pts and 16 in peer.batched_decode_tok_s:
                agg = pts[16].engine_decode_tok_s / peer.batched_decode_tok_s[16]
                out[f"batch16_aggregate_at_least_3x_llamacpp_batched_{tr.threads}t"] = agg >= 3.0
    if report.quality is not None:
        out["perplexity_within_0.5pct_of_the_dequantised_path"] = report.quality.decode_over_dequantised <= 1.005
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.engine``: the same command without the rest of ``disagg`` (GPU machines
    that have torch but not the serving stack)."""
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

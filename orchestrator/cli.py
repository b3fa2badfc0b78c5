"""``disagg``: build engines, generate, chat, launch deployments, benchmark."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from builders import BuildError, BuildOptions, build_engine
from builders.build import default_engine_dir
from torch_engine.config import DType, EngineConfig, KVLayout, Role
from torch_engine.sampling import InvalidRequestError, SamplingParams

DEFAULT_CACHE = Path.home() / ".cache" / "disagg" / "engines"


def _build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="checkpoint: 'smollm2' (embedded), a .gguf file or an HF folder")
    p.add_argument("--dtype", choices=[d.value for d in DType], default=DType.BFLOAT16.value)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layout", choices=[k.value for k in KVLayout], default=KVLayout.HND.value)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where built engines are cached")


def _options(a: argparse.Namespace, role: Role = Role.COLOCATED) -> BuildOptions:
    return BuildOptions(
        role=role, tp_size=a.tp, dtype=DType(a.dtype), page_size=a.page_size, kv_layout=KVLayout(a.layout)
    )


def _engine_dir(a: argparse.Namespace, role: Role = Role.COLOCATED) -> Path:
    if getattr(a, "engine", None):
        return Path(a.engine)
    opts = _options(a, role)
    return build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--engine", type=Path, default=None, help="use this engine directory instead of building one")


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        stop=tuple(a.stop),
    )


def _engine(a: argparse.Namespace):
    from torch_engine.engine import LLMEngine

    return LLMEngine(EngineConfig(engine_dir=_engine_dir(a), num_threads=a.threads, max_num_seqs=16))


def _stream_answer(engine, prompt: str, params: SamplingParams, chat: bool) -> None:
    from torch_engine.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(engine.tokenizer)
    start = time.perf_counter()
    first: float | None = None
    n = 0
    for out in engine.stream(prompt, params, chat=chat):
        first = first or time.perf_counter()
        n += len(out.new_token_ids)
        sys.stdout.write(detok.push(out.new_token_ids))
        sys.stdout.flush()
    end = time.perf_counter()
    if first is not None:
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(
            f"\n[{n} tokens, TTFT {1000 * (first - start):.0f} ms, {rate:.1f} tokens/s after the first]",
            file=sys.stderr,
        )


def cmd_build(a: argparse.Namespace) -> int:
    opts = _options(a, Role(a.role))
    out = a.output or default_engine_dir(a.cache_dir, a.model, opts)
    print(build_engine(a.model, out, opts))
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    engine = _engine(a)
    _stream_answer(engine, a.prompt, _params(a), a.chat)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    engine = _engine(a)
    print("disagg chat on the embedded engine. Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        try:
            _stream_answer(engine, line, _params(a), chat=True)
        except InvalidRequestError as exc:
            print(f"error: {exc}", file=sys.stderr)


def cmd_bench_engine(a: argparse.Namespace) -> int:
    from orchestrator.bench_engine import run_engine_bench

    return run_engine_bench(a, _engine_dir)


def cmd_bench_transfer(a: argparse.Namespace) -> int:
    from orchestrator.bench_transfer import run_transfer_bench

    return run_transfer_bench(a, _engine_dir)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from orchestrator.bench_serve import run_serve_bench

    return run_serve_bench(a)


def cmd_launch(a: argparse.Namespace) -> int:
    from orchestrator.launch_cli import run

    return run(a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build an engine directory from a checkpoint")
    _build_args(b)
    b.add_argument("--role", choices=[r.value for r in Role], default=Role.COLOCATED.value)
    b.add_argument("--output", type=Path, default=None)
    b.set_defaults(fn=cmd_build)

    g = sub.add_parser("generate", help="stream a completion to the terminal")
    _build_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat on the engine")
    _build_args(c)
    _sampling_args(c)
    c.set_defaults(fn=cmd_chat)

    la = sub.add_parser("launch", help="start a deployment from a cluster config (mpirun), serve until Ctrl-C")
    from orchestrator.launch_cli import add_arguments

    add_arguments(la)
    la.set_defaults(fn=cmd_launch)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="engine prefill/decode throughput vs HF transformers and the memory floor")
    _build_args(be)
    be.set_defaults(dtype=DType.FLOAT32.value)
    be.add_argument("--threads", type=int, default=2)
    be.add_argument("--prompt-len", type=int, default=256)
    be.add_argument("--decode-tokens", type=int, default=32)
    be.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    be.add_argument("--repeats", type=int, default=3, help="alternating engine / HF runs per batch size (median)")
    be.add_argument("--json", type=Path, default=None, help="write every figure and ratio here")
    be.add_argument("--engine", type=Path, default=None, help="use this engine directory instead of building one")
    be.set_defaults(fn=cmd_bench_engine)

    bt = bsub.add_parser(
        "transfer", help="KV messenger vs raw NIXL vs memcpy; exposed time with layer streaming on/off"
    )
    _build_args(bt)
    bt.set_defaults(dtype=DType.FLOAT32.value)
    bt.add_argument("--engine", type=Path, default=None, help="use this engine directory instead of building one")
    bt.add_argument("--tokens", type=int, default=2048, help="prompt length of the realistic request")
    bt.add_argument("--chunk", type=int, default=512, help="prefill chunk (token budget per step)")
    bt.add_argument("--threads", type=int, default=1, help="torch threads of the prefill engine")
    bt.add_argument("--repeats", type=int, default=3)
    bt.add_argument("--backend", choices=["UCX", "LIBFABRIC"], default="UCX")
    bt.add_argument("--json", type=Path, default=None, help="write every figure and ratio here")
    bt.set_defaults(fn=cmd_bench_transfer)

    bs = bsub.add_parser("serve", help="colocated vs disaggregated deployments on equal hardware: TTFT, ITL, goodput")
    bs.add_argument("--model", default="smollm2")
    bs.add_argument("--engine", type=Path, default=None, help="use this (fp32, TP 1) engine directory")
    bs.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    bs.add_argument("--workloads", nargs="+", default=["prefill-heavy", "decode-heavy", "chat"],
                    choices=["prefill-heavy", "decode-heavy", "chat"])  # fmt: skip
    bs.add_argument("--requests", type=int, default=16, help="requests per rate point (the same file for both modes)")
    bs.add_argument("--rates", type=float, nargs="+", default=None, help="request rates (req/s); default: multiples")
    bs.add_argument("--rate-multiples", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 1.0],
                    help="of the estimated colocated saturation rate")  # fmt: skip
    bs.add_argument("--prefill-ratio", type=float, default=10.0, help="prefill-heavy: prefill time / decode step")
    bs.add_argument("--calibrate-lengths", type=int, nargs="+", default=[128, 160, 192, 224, 256, 320, 384, 512])
    bs.add_argument("--chunk", type=int, default=128, help="token budget per step (chunked prefill)")
    bs.add_argument("--cores", type=int, nargs=2, default=[0, 1], help="the two cores both modes get")
    bs.add_argument("--layers-per-post", type=int, default=8,
                    help="disaggregated prefill: post KV every N finished layers (copies share its core)")  # fmt: skip
    bs.add_argument("--idle-requests", type=int, default=3, help="serial requests for the idle SLO baseline")
    bs.add_argument("--max-seconds", type=float, default=150.0, help="bound on one rate point")
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--out", type=Path, default=Path("runs/bench_serve"))
    bs.add_argument("--json", type=Path, default=None, help="every figure and ratio (default OUT/bench_serve.json)")
    bs.set_defaults(fn=cmd_bench_serve)

    a = parser.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(a.fn(a))
    except (BuildError, InvalidRequestError, FileNotFoundError) as exc:
        print(f"disagg: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

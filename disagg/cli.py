"""``disagg``: build engines, generate, chat, launch deployments, benchmark.

A short dispatcher: each command's module owns its arguments (``add_arguments``) and its entry
point (``run``). The command lives here, above both ``orchestrator`` (deploy time) and ``bench``,
so that neither of those imports the other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from bench import engine as bench_engine
from bench import guided as bench_guided
from bench import speculative as bench_spec
from bench import transfer as bench_transfer
from bench.serve import cli as bench_serve
from bench.serve import overload as bench_overload
from bench.serve import prefix as bench_prefix
from bench.serve import validate as plan_validate
from builders import BuildError, train_mtp
from orchestrator import engine_cli, launch_cli
from torch_engine.sampling import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS = [
    Command("build", "build an engine directory from a checkpoint",
            engine_cli.add_build_arguments, engine_cli.run_build),
    Command("generate", "stream a completion to the terminal",
            engine_cli.add_generate_arguments, engine_cli.run_generate),
    Command("chat", "interactive chat on the engine", engine_cli.add_chat_arguments, engine_cli.run_chat),
    Command("launch", "start a deployment from a cluster config (mpirun), serve until Ctrl-C",
            launch_cli.add_arguments, launch_cli.run),
    Command("plan", "colocated vs disaggregated plans (P:D, TP) by simulation: goodput, TTFT / TPOT",
            plan_validate.add_arguments, plan_validate.run),
    Command("train-mtp", "train an MTP head for a checkpoint without one (self-distillation)",
            train_mtp.add_arguments, train_mtp.run),
]  # fmt: skip
BENCHES = [
    Command("engine", "engine decode / prefill speed vs HF transformers and the memory floor",
            bench_engine.add_arguments, bench_engine.run),
    Command("transfer", "KV messenger vs raw NIXL vs memcpy; exposed time with layer streaming on/off",
            bench_transfer.add_arguments, bench_transfer.run),
    Command("serve", "colocated vs disaggregated deployments on equal hardware: TTFT, ITL, goodput",
            bench_serve.add_arguments, bench_serve.run),
    Command("prefix", "prefix cache off vs on, colocated and disaggregated: multi-turn chat, shared system prompts",
            bench_prefix.add_arguments, bench_prefix.run),
    Command("overload", "a deployment offered 3x its capacity through the router: shed answers, admitted TTFT, memory",
            bench_overload.add_arguments, bench_overload.run),
    Command("guided", "the decode step with and without a JSON-schema guide on every request, side by side",
            bench_guided.add_arguments, bench_guided.run),
    Command("spec", "decode speed with and without speculative decoding (n-gram, MTP), acceptance",
            bench_spec.add_arguments, bench_spec.run),
]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in COMMANDS:
        cp = sub.add_parser(c.name, help=c.help)
        c.add_arguments(cp)
        cp.set_defaults(fn=c.run)
    bsub = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for c in BENCHES:
        bp = bsub.add_parser(c.name, help=c.help)
        c.add_arguments(bp)
        bp.set_defaults(fn=c.run)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(a.fn(a))
    except (BuildError, InvalidRequestError, FileNotFoundError, ValueError) as exc:
        print(f"disagg: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

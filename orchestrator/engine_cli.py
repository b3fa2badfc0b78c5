"""``disagg build``, ``disagg generate``, ``disagg chat``: engines from checkpoints, and the engine at a terminal.

The arguments every command that needs an engine shares are ``builders.arguments``'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from builders import build_engine
from builders.arguments import build_options, engine_dir_of, engine_source_arguments
from builders.build import default_engine_dir
from torch_engine.config import EngineConfig, Role, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import InvalidRequestError, SamplingParams
from torch_engine.tokenizer import IncrementalDetokenizer


# -- disagg build ---------------------------------------------------------------------------
def add_build_arguments(p: argparse.ArgumentParser) -> None:
    engine_source_arguments(p)
    p.add_argument("--role", choices=[r.value for r in Role], default=Role.COLOCATED.value)
    p.add_argument("--output", type=Path, default=None)


def run_build(a: argparse.Namespace) -> int:
    opts = build_options(a, Role(a.role))
    print(build_engine(a.model, a.output or default_engine_dir(a.cache_dir, a.model, opts), opts))
    return 0


# -- disagg generate / chat -------------------------------------------------------------------
def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    engine_source_arguments(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_chat_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")


def _params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        stop=tuple(a.stop),
    )


def _engine(a: argparse.Namespace) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_seqs=16)
    return LLMEngine(EngineConfig(engine_dir=engine_dir_of(a), num_threads=a.threads, scheduler=scheduler))


def _stream_answer(engine: LLMEngine, prompt: str, params: SamplingParams, chat: bool) -> None:
    if engine.tokenizer is None:
        raise InvalidRequestError("this engine has no tokenizer")
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


def run_generate(a: argparse.Namespace) -> int:
    _stream_answer(_engine(a), a.prompt, _params(a), a.chat)
    return 0


def run_chat(a: argparse.Namespace) -> int:
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

"""``disagg bench guided``: what constrained decoding costs a decode step, side by side.

The same engine decodes the same batch of requests twice per repeat, alternating: free, then each
request under a JSON schema (an object whose one string must be at least ``--min-chars`` long, so
that no request ends before the measured steps do). Measured: the wall time of every engine step
in which the whole batch decodes (after each request's first token), median per run; reported: the
medians, guided over free, and the issue's goal (constrained decoding costs <= 10 % of the decode
step at batch 8). The guided replies are checked too, as far as a reply cut by ``--decode-tokens``
can be: each one opens the schema's object (``{"description":``).
The masks are computed on the engine's worker thread while the forward pass runs (``guided.py``).
The CPU model and flags and the kernel path are recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from builders import BuildOptions, build_engine
from builders.build import DEFAULT_ENGINE_CACHE, default_engine_dir
from torch_engine.config import NO_PREFIX_CACHE, DType, EngineConfig, Role, SchedulerConfig
from torch_engine.cpu import cpu_info
from torch_engine.engine import LLMEngine
from torch_engine.guided import Guide, GuideKind
from torch_engine.sampling import SamplingParams

PROMPT = "Write a long description of a walk through an old city, as JSON."


def schema(min_chars: int) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {"description": {"type": "string", "minLength": min_chars}},
        "required": ["description"],
        "additionalProperties": False,
    }


@dataclass(slots=True)
class Point:
    batch: int
    free_step_ms: float
    guided_step_ms: float
    ratio: float
    steps_measured: int
    guided_replies_valid: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_ENGINE_CACHE)
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens per request (the steps measured)")
    p.add_argument("--min-chars", type=int, default=400, help="the schema's string: longer than the decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)


def _steps(engine: LLMEngine, prompt: list[int], batch: int, params: SamplingParams) -> tuple[list[float], list[str]]:
    """Wall times of the steps in which all ``batch`` requests decode; the replies' text."""
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    times: list[float] = []
    while engine.has_unfinished():
        decoding = all(engine.request(i).output_ids for i in ids) and not any(engine.request(i).finished for i in ids)
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
    tok = engine.tokenizer
    assert tok is not None
    texts = [tok.decode(list(engine.request(i).output_ids)) for i in ids]
    for i in ids:
        engine.retire(i)
    return times, texts


def run(a: argparse.Namespace) -> int:
    opts = BuildOptions(role=Role.COLOCATED, tp_size=1, dtype=DType.FLOAT32, page_size=16)
    engine_dir = build_engine(a.model, default_engine_dir(a.cache_dir, a.model, opts), opts, progress=False)
    cfg = EngineConfig(
        engine_dir=engine_dir, dtype="auto", num_pages=1024, num_threads=a.threads, prefix_cache=NO_PREFIX_CACHE,
        scheduler=SchedulerConfig(max_num_seqs=max(a.batch), max_num_batched_tokens=512),
    )  # fmt: skip
    engine = LLMEngine(cfg)
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(PROMPT, chat=True)
    want = schema(a.min_chars)
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(want))
    free = SamplingParams(max_tokens=a.decode_tokens, ignore_eos=True)
    guided = SamplingParams(max_tokens=a.decode_tokens, ignore_eos=True, guide=guide)
    _steps(engine, prompt, 1, guided)  # warm-up: the token table, the schema's compile
    points: list[Point] = []
    for batch in a.batch:
        runs: dict[str, list[float]] = {"free": [], "guided": []}
        valid, measured = True, 0
        for _ in range(a.repeats):
            times, _ = _steps(engine, prompt, batch, free)
            runs["free"].append(statistics.median(times))
            times, texts = _steps(engine, prompt, batch, guided)
            runs["guided"].append(statistics.median(times))
            measured += len(times)
            valid = valid and all(_prefix_of_valid(t) for t in texts)
        f, g = statistics.median(runs["free"]), statistics.median(runs["guided"])
        points.append(Point(batch, 1000 * f, 1000 * g, g / f, measured, valid))
        print(f"batch {batch:2d}: step {1000 * f:.2f} ms free, {1000 * g:.2f} ms guided ({g / f:.3f}x), "
              f"guided replies valid so far: {valid}", flush=True)  # fmt: skip
    report = {
        "cpu": cpu_info().as_dict(),
        "kernel_path": engine.kernel_path,
        "schema": want,
        "decode_tokens": a.decode_tokens,
        "points": [asdict(p) for p in points],
        "goal_at_8": next((p.ratio <= 1.10 for p in points if p.batch == 8), None),
    }
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(json.dumps(report["points"], indent=2))
    return 0 if all(p.guided_replies_valid for p in points) else 1


def _prefix_of_valid(text: str) -> bool:
    """A reply cut by max_tokens inside the schema's string: the text so far opens that object."""
    stripped = text.lstrip()
    return stripped.startswith('{"description":') or stripped.startswith('{ "description":')

"""``disagg bench spec``: decode speed with and without speculative decoding (n-gram or MTP), side by side.

For each workload (prompts whose continuations repeat earlier text to different degrees) and each
batch size, the same engine settings run the same greedy requests with speculation off and on,
alternating, ``repeats`` times; reported: output tokens per second of the decode phase (median),
the ratio on / off, draft tokens proposed / accepted, and whether the outputs were identical
(they must be: speculation is lossless). The CPU model and flags and the kernel path are recorded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from builders import BuildOptions, build_engine
from torch_engine.config import DType, EngineConfig, SchedulerConfig, SpecMethod, SpeculativeConfig
from torch_engine.cpu import cpu_info
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

WORKLOADS = {
    # the continuation copies text from the prompt (editing, extraction): drafts are mostly right
    "copy": "Repeat the following list exactly, one item per line:\n"
    + "\n".join(f"- item {i}: the {w} box is on the {s} shelf" for i, (w, s) in enumerate(
        [("red", "top"), ("blue", "middle"), ("green", "bottom"), ("black", "left"), ("white", "right")] * 2))
    + "\nRepeated list:\n",
    # code with repeated structure
    "code": "def area(shape, a, b=0):\n    if shape == 'square':\n        return a * a\n"
    "    if shape == 'rectangle':\n        return a * b\n    if shape == 'triangle':\n        return a * b / 2\n"
    "\n\ndef perimeter(shape, a, b=0):\n    if shape == 'square':\n",
    # free text: little to copy
    "chat": "Why is the sky blue? Explain it to a ten-year-old in a few sentences.",
    # free text of the kind `disagg train-mtp` trains its heads on (one of its own prompts): what a
    # head does on text like its training data, next to the three above, which it never saw
    "trained": "Explain photosynthesis to a ten-year-old.",
}  # fmt: skip


@dataclass(slots=True)
class Point:
    workload: str
    batch: int
    plain_tok_s: float
    spec_tok_s: float
    ratio: float
    proposed: int
    accepted: int
    acceptance: float
    identical: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--dtype", choices=["auto", *(d.value for d in DType)], default="auto")
    p.add_argument("--method", choices=[SpecMethod.NGRAM.value, SpecMethod.MTP.value], default=SpecMethod.NGRAM.value)
    p.add_argument("--mtp-head", type=Path, default=None, help="MTP head to attach (disagg train-mtp) for --method mtp")
    p.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step (k; MTP drafts 1)")
    p.add_argument("--max-batch", type=int, default=None, help="speculative.max_batch: no drafting above it")
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)


def _decode(engine: LLMEngine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], tuple[int, int]]:
    """Decode-phase output tokens per second (after the step that samples the first token)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    before = (engine.spec_stats.proposed, engine.spec_stats.accepted)
    ids = [engine.add_request(p, params) for p in prompts]
    while any(not engine.request(i).output_ids for i in ids):  # prefill, first token
        engine.step()
    done_first = sum(len(engine.request(i).output_ids) for i in ids)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    dt = time.perf_counter() - t0
    outs = [list(engine.request(i).output_ids) for i in ids]
    for i in ids:
        engine.retire(i)
    total = sum(len(o) for o in outs) - done_first
    drafts = (engine.spec_stats.proposed - before[0], engine.spec_stats.accepted - before[1])
    return total / dt, outs, drafts


def run(a: argparse.Namespace) -> int:
    cache = Path.home() / ".cache" / "disagg" / "engines"
    method = SpecMethod(a.method)
    opts = BuildOptions(dtype=DType.FLOAT32, mtp_head=a.mtp_head)
    engine_dir = build_engine(a.model, cache / f"bench-spec-{method.value}", opts, progress=False)
    base = {"engine_dir": engine_dir, "dtype": a.dtype, "num_pages": 512, "num_threads": a.threads}
    base["scheduler"] = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    plain = LLMEngine(EngineConfig.model_validate(base))
    k = 1 if method is SpecMethod.MTP else a.num_tokens
    spec_cfg = SpeculativeConfig(method=method, num_tokens=k, max_batch=a.max_batch)
    spec = LLMEngine(EngineConfig.model_validate(base | {"speculative": spec_cfg}))
    tok = plain.tokenizer
    assert tok is not None
    points: list[Point] = []
    for name, text in WORKLOADS.items():
        prompt = tok.encode(text, chat=name in ("chat", "trained"))
        for batch in a.batch:
            prompts = [prompt] * batch
            runs: dict[str, list[float]] = {"plain": [], "spec": []}
            outs: dict[str, list[list[int]]] = {}
            drafts = (0, 0)
            for _ in range(a.repeats):
                speed, outs["plain"], _ = _decode(plain, prompts, a.decode_tokens)
                runs["plain"].append(speed)
                speed, outs["spec"], drafts = _decode(spec, prompts, a.decode_tokens)
                runs["spec"].append(speed)
            p, s = statistics.median(runs["plain"]), statistics.median(runs["spec"])
            proposed, accepted = drafts
            point = Point(name, batch, p, s, s / p, proposed, accepted, accepted / max(proposed, 1),
                          outs["plain"] == outs["spec"])  # fmt: skip
            points.append(point)
            print(f"{name:5s} batch {batch:2d}: {p:6.1f} -> {s:6.1f} tok/s ({s / p:.2f}x), "
                  f"accepted {accepted}/{proposed} ({point.acceptance:.0%}), identical {point.identical}")  # fmt: skip
    report = {
        "cpu": cpu_info().as_dict(),
        "kernel_path": spec.kernel_path,
        "method": method.value,
        "num_tokens": k,
        "max_batch": a.max_batch,
        "decode_tokens": a.decode_tokens,
        "points": [asdict(p) for p in points],
    }
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    # fp32 must be identical token for token; in bf16 the verify pass (several rows per request) runs
    # other kernels than a decode row, and near-tied argmaxes may flip, as they do between batch sizes
    return 0 if all(p.identical for p in points) or spec.describe().dtype != torch.float32 else 1

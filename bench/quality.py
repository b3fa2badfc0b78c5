"""Quality of an engine's compute path against another's on the same weights: perplexity on a fixed
text, and the top-token agreement of teacher-forced next-token distributions.

Both read the prompt log-probabilities the engine reports (vLLM's ``prompt_logprobs``), so the text is
fed through the engine's own scheduler: with ``chunk`` = 1 every position is a one-token step — the
decode path (on the CPU fast path, the compiled decode step); with larger chunks, prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch_engine.config import DType, EngineConfig, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams, TokenLogprobs

DATA = Path(__file__).resolve().parent / "data"
TEXT = DATA / "perplexity.txt"  # public-domain prose, ~640 SmolLM2 tokens (the tests)
LONG_TEXT = DATA / "perplexity-long.txt"  # that, and a fixed snapshot of this project's prose: ~4,300 tokens


def prompt_logprobs(engine: LLMEngine, ids: Sequence[int], top: int = 1) -> list[TokenLogprobs]:
    """Each position's log-probability of its token (and the ``top`` most likely), the first excluded."""
    rid = engine.add_request(list(ids), SamplingParams(max_tokens=1, prompt_logprobs=top))
    found: tuple[TokenLogprobs | None, ...] = ()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.prompt_logprobs:
                found = out.prompt_logprobs
    engine.retire(rid)
    lps = [lp for lp in found[1:] if lp is not None]
    if len(lps) != len(ids) - 1:
        raise RuntimeError(f"the engine reported {len(lps)} prompt log-probabilities for {len(ids)} tokens")
    return lps


def perplexity(engine: LLMEngine, ids: Sequence[int]) -> float:
    lps = prompt_logprobs(engine, ids, top=0)
    return math.exp(-sum(lp.logprob for lp in lps) / len(lps))


def top1_agreement(a: list[TokenLogprobs], b: list[TokenLogprobs]) -> float:
    """Share of positions whose most likely next token is the same in both."""
    same = sum(x.top_ids[:1] == y.top_ids[:1] for x, y in zip(a, b, strict=True))
    return same / len(a)


@dataclass(frozen=True, slots=True)
class Quality:
    """The fast path (weights as stored, integer GEMMs, the compiled decode step) against the same weights
    dequantised at load and run on the reference path in the same dtype (the issue's "dequantised path"),
    on ``LONG_TEXT``; and the fp32 reference for scale."""

    tokens: int
    dtype: str
    ppl_dequantised: float  # the reference path, same dtype
    ppl_fp32: float  # the reference path in fp32
    ppl_decode: float  # fast path, one token a step: the decode path
    ppl_prefill: float  # fast path, 16-token chunks: prefill rows on the integer GEMM
    top1_agreement: float  # teacher-forced next token, 16-token chunks vs the dequantised path

    @property
    def decode_over_dequantised(self) -> float:
        return self.ppl_decode / self.ppl_dequantised

    @property
    def prefill_over_dequantised(self) -> float:
        return self.ppl_prefill / self.ppl_dequantised


def measure_quality(engine_dir: Path, run_dtype: DType | Literal["auto"], max_tokens: int = 4096) -> Quality:
    def engine(fast: bool, chunk: int, dtype: DType | Literal["auto"] = run_dtype) -> LLMEngine:
        sched = SchedulerConfig(max_prefill_chunk=chunk, max_num_batched_tokens=max(chunk, 16))
        cfg = EngineConfig(engine_dir=engine_dir, fast_cpu=fast, dtype=dtype, num_pages=max_tokens // 4)
        return LLMEngine(cfg.model_copy(update={"scheduler": sched}))

    fast16 = engine(True, 16)
    # the reference in the dtype the fast path runs: a concrete one, since `dtype: auto` itself turns the fast
    # CPU path on (kept packed, integer GEMMs), which is what this compares against
    ref = engine(False, 512, DType(str(fast16.describe().dtype).removeprefix("torch.")))
    assert "int8" not in ref.kernel_path, ref.kernel_path
    assert ref.tokenizer is not None, "the quality measurement needs the engine's tokenizer"
    ids = ref.tokenizer.encode(LONG_TEXT.read_text(encoding="utf-8"))[:max_tokens]
    a = prompt_logprobs(ref, ids, top=1)
    b = prompt_logprobs(fast16, ids, top=1)

    def ppl(lps: list[TokenLogprobs]) -> float:
        return math.exp(-sum(x.logprob for x in lps) / len(lps))

    return Quality(
        len(ids), str(ref.describe().dtype).removeprefix("torch."), ppl(a),
        perplexity(engine(False, 512, DType.FLOAT32), ids), perplexity(engine(True, 1), ids), ppl(b),
        top1_agreement(a, b),
    )  # fmt: skip

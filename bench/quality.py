"""Quality of an engine's compute path against another's on the same weights: perplexity on a fixed
text, and the top-token agreement of teacher-forced next-token distributions.

Both read the prompt log-probabilities the engine reports (vLLM's ``prompt_logprobs``), so the text is
fed through the engine's own scheduler: with ``chunk`` = 1 every position is a one-token step — the
decode path (on the CPU fast path, the compiled decode step); with larger chunks, prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams, TokenLogprobs

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"  # public-domain prose, ~640 SmolLM2 tokens


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

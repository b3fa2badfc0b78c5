"""Seeded request files and arrival schedules for ``disagg bench serve`` (DESIGN section 6).

Workloads (every prompt is random vocabulary text, so the content never changes the cost):

- ``prefill-heavy``: prompts of ``prefill_len`` tokens (calibrated so that the prefill takes
  about 10 decode steps on this machine), 64-128 output tokens;
- ``decode-heavy``: short prompts (16-48 tokens), long outputs (128-192);
- ``chat``: a chat-like mix: prompt lengths log-uniform in [32, 2 x prefill_len], outputs 32-160.

Every request asks for exactly its ``max_tokens`` (``ignore_eos``), so both modes do the same
work. Arrivals are a seeded Poisson process, identical for both modes at a given rate.
"""

from __future__ import annotations

import enum
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from torch_engine.tokenizer import Tokenizer


class Workload(enum.Enum):
    PREFILL_HEAVY = "prefill-heavy"
    DECODE_HEAVY = "decode-heavy"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    prompt_tokens: int
    max_tokens: int


def _text(tok: Tokenizer, rng: random.Random, length: int) -> tuple[str, int]:
    """Random vocabulary text of about ``length`` tokens (decode -> re-encode can shift it a little)."""
    ids = [rng.randrange(1000, 20000) for _ in range(length)]
    text = tok.decode(ids)
    n = len(tok.encode(text))
    while n > length and len(ids) > 1:  # trim back to the target
        ids = ids[: len(ids) - (n - length)]
        text = tok.decode(ids)
        n = len(tok.encode(text))
    return text, n


def make_requests(tok: Tokenizer, workload: Workload, n: int, prefill_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(f"{workload.value}-{seed}")
    out = []
    for _ in range(n):
        if workload is Workload.PREFILL_HEAVY:
            length, max_tokens = prefill_len, rng.randint(64, 128)
        elif workload is Workload.DECODE_HEAVY:
            length, max_tokens = rng.randint(16, 48), rng.randint(128, 192)
        else:
            length = int(math.exp(rng.uniform(math.log(32), math.log(2 * prefill_len))))
            max_tokens = rng.randint(32, 160)
        text, actual = _text(tok, rng, length)
        out.append(BenchRequest(text, actual, max_tokens))
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``n`` requests arrives (mean ``rate`` per second)."""
    rng = random.Random(f"arrivals-{seed}-{rate:.6f}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def save_requests(path: Path, requests: list[BenchRequest]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(asdict(r)) for r in requests) + "\n", encoding="utf-8")

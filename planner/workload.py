"""A workload for the planner: input / output length distributions (or a request file), a rate, SLOs.

Lengths are ``N`` (fixed), ``A-B`` (uniform integers) or ``lognormal:MEDIAN:SIGMA``; a request file
is the serving benchmark's own (``requests-<workload>.jsonl``: ``prompt_tokens``, ``max_tokens``
per line), so the planner simulates exactly the requests the benchmark sent. Arrivals are Poisson.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Lengths:
    kind: str  # fixed | uniform | lognormal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        try:
            if text.startswith("lognormal:"):
                _, median, sigma = text.split(":")
                return cls("lognormal", float(median), float(sigma))
            if "-" in text:
                lo, hi = text.split("-")
                if int(lo) > int(hi) or int(lo) < 1:
                    raise ValueError
                return cls("uniform", int(lo), int(hi))
            if int(text) < 1:
                raise ValueError
            return cls("fixed", int(text))
        except ValueError:
            raise ValueError(f"lengths {text!r}: use N, A-B or lognormal:MEDIAN:SIGMA (tokens >= 1)") from None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(math.exp(rng.gauss(math.log(self.a), self.b))))


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[tuple[int, int]]  # (prompt tokens, output tokens); sampled, or from a request file

    @classmethod
    def sampled(cls, name: str, inputs: Lengths, outputs: Lengths, n: int, seed: int = 0) -> Workload:
        rng = random.Random(f"planner-{name}-{seed}")
        return cls(name, [(max(inputs.sample(rng), 1), max(outputs.sample(rng), 1)) for _ in range(n)])

    @classmethod
    def from_file(cls, path: Path, name: str | None = None) -> Workload:
        rows = [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
        if not rows:
            raise ValueError(f"{path}: no requests")
        try:
            reqs = [(int(r["prompt_tokens"]), int(r["max_tokens"])) for r in rows]
        except KeyError as exc:
            raise ValueError(f"{path}: each line needs prompt_tokens and max_tokens (missing {exc})") from None
        return cls(name or Path(path).stem.removeprefix("requests-"), reqs)

    def arrivals(self, rate: float, seed: int = 0) -> list[float]:
        rng = random.Random(f"planner-arrivals-{seed}-{rate:.6f}")
        t, out = 0.0, []
        for _ in self.requests:
            out.append(t)
            t += rng.expovariate(rate)
        return out

    @property
    def mean_input(self) -> float:
        return sum(i for i, _ in self.requests) / len(self.requests)

    @property
    def mean_output(self) -> float:
        return sum(o for _, o in self.requests) / len(self.requests)

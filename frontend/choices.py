"""Several choices of one request (``n`` > 1, or ``/v1/completions`` with a list of prompts).

Each prompt's first choice runs alone until its first token: by then the decode group that serves
it holds the prompt's KV — its full pages in the prefix cache, its last partial page in the first
choice's own pages. The prompt's other choices then go to that same group (``prefer``), where they
share the full pages, copy the partial one from the running first choice (``PrefixCache.tail``) and
compute only the prompt's last token: the prompt is computed once and, under disaggregation,
transferred once (a first choice that has already ended leaves no partial page: the others then
compute its few tokens, or move that one page). Choice ``j`` of a prompt samples with
the request's seed + ``j`` (each its own stream; no seed: each draws its own). Usage counts each
prompt once. A choice that fails fails the request (the others are cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from frontend.generation import Delta, Generator, Outcome
from torch_engine.sampling import SamplingParams


@dataclass(slots=True)
class Ran:
    """One choice, run to its end."""

    prompt: int  # which prompt (index into the request's prompts)
    deltas: list[Delta]
    outcome: Outcome


Sink = Callable[[int, Delta, Outcome], None]  # (choice index, a delta of it, its outcome so far)


async def collect(
    gen: Generator, ids: list[int], s: SamplingParams, rid: str, outcome: Outcome,
    started: asyncio.Event | None = None, prefer: str | None = None, sink: Callable[[Delta], None] | None = None,
) -> list[Delta]:  # fmt: skip
    """All of one choice's deltas (``started`` is set at its first, or when it ends without one;
    ``sink`` gets each as it comes: streaming)."""
    out: list[Delta] = []
    try:
        async with contextlib.aclosing(gen.deltas(ids, s, rid, outcome, prefer)) as deltas:
            async for d in deltas:
                out.append(d)
                if sink is not None:
                    sink(d)
                if started is not None:
                    started.set()
    finally:
        if started is not None:
            started.set()
    return out


async def collect_all(deltas: AsyncGenerator[Delta, None]) -> list[Delta]:
    """Every delta of one stream (closed at the end, or when the caller is cancelled)."""
    async with contextlib.aclosing(deltas) as ds:
        return [d async for d in ds]


def seeded(s: SamplingParams, j: int) -> SamplingParams:
    """Choice ``j``'s sampling: the request's seed + j (none given: the engine draws one per choice)."""
    return s if j == 0 or s.seed is None else dataclasses.replace(s, seed=(s.seed + j) % 2**63)


async def run(
    gen: Generator, prompts: list[list[int]], s: SamplingParams, rid: str, n: int, sink: Sink | None = None
) -> list[Ran]:
    """Every choice (``n`` per prompt, in order: prompt 0's, then prompt 1's, ...); ``sink`` gets every
    delta as it comes, with its choice's index."""

    def to(i: int, outcome: Outcome) -> Callable[[Delta], None] | None:
        return None if sink is None else lambda d: sink(i, d, outcome)

    async def follow(p: int, j: int, outcome: Outcome, started: asyncio.Event, lead: Outcome) -> list[Delta]:
        await started.wait()
        i = p * n + j
        return await collect(gen, prompts[p], seeded(s, j), f"{rid}-{p}-{j}", outcome, None, lead.group, to(i, outcome))

    runs: list[Ran] = []
    tasks: list[asyncio.Task[list[Delta]]] = []
    for p, ids in enumerate(prompts):
        lead, started = Outcome(prompt_tokens=len(ids)), asyncio.Event()
        runs.append(Ran(p, [], lead))
        tasks.append(asyncio.create_task(collect(gen, ids, s, f"{rid}-{p}-0", lead, started, sink=to(p * n, lead))))
        for j in range(1, n):
            outcome = Outcome(prompt_tokens=len(ids))
            runs.append(Ran(p, [], outcome))
            tasks.append(asyncio.create_task(follow(p, j, outcome, started, lead)))
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for r, deltas in zip(runs, results, strict=True):
        r.deltas = deltas
    return runs


def best(runs: list[Ran], n: int, width: int) -> list[Ran]:
    """``best_of``: per prompt, the ``n`` of its ``width`` choices with the highest cumulative
    log-probability of their tokens, best first (vLLM's and OpenAI's rule)."""
    out: list[Ran] = []
    for start in range(0, len(runs), width):
        mine = runs[start : start + width]
        out += sorted(mine, key=lambda r: -sum(lp.logprob for d in r.deltas for lp in d.logprobs))[:n]
    return out

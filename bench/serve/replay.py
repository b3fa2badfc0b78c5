"""Load: each request sent at its (seeded Poisson) arrival time over Triton gRPC streaming, round-robin
over a deployment's decode groups, or through the router's OpenAI API; every point bounded in time;
and the idle baseline."""

from __future__ import annotations

import asyncio
import statistics
import time

from tqdm import tqdm

from bench.serve.deploy import Frontend, Targets
from bench.serve.workloads import BenchRequest
from orchestrator.client import Completion, complete_via_router, generate
from serving.grpc_channel import aio_client


async def replay(
    to: Targets,
    requests: list[BenchRequest],
    arrivals: list[float],
    tag: str,
    max_seconds: float,
    bar: tqdm | None = None,
) -> tuple[list[Completion], float]:
    """Send each request at its arrival time (round-robin over the targets); returns them and the wall time.
    ``tag`` is also every request's cache salt: a point never reuses the KV another point (or the idle
    baseline) cached for the same prompts — each point measures prefill, not the prefix cache."""
    clients = [aio_client(u) for u in to.urls] if to.frontend is Frontend.TRITON else []
    start = time.monotonic()

    async def send(i: int, req: BenchRequest, rid: str) -> Completion:
        if to.frontend is Frontend.ROUTER:
            url, model = to.urls[0], to.model
            return await complete_via_router(
                url, model, req.prompt, req.max_tokens, rid, True, to.api_key, cache_salt=tag
            )
        client = clients[i % len(clients)]
        return await generate(client, req.prompt, req.max_tokens, rid, ignore_eos=True, cache_salt=tag)

    async def one(i: int, req: BenchRequest) -> Completion:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - start)))
        done = await send(i, req, f"{tag}-{i}")
        if bar is not None:
            bar.update(1)
        return done

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(requests)]
    finished, pending = await asyncio.wait(tasks, timeout=max_seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - start
    for c in clients:
        await c.close()
    out = []
    for i, t in enumerate(tasks):
        if t in finished and t.exception() is None:
            out.append(t.result())
        else:
            c = Completion(f"{tag}-{i}", 0.0)
            c.error = f"not finished within the {max_seconds:.0f} s bound"
            out.append(c)
    return out, wall


def measure_idle(to: Targets, reqs: list[BenchRequest], tag: str) -> dict[str, float]:
    """One request at a time (to the first target): the first warms up, the rest give the idle TTFT and step."""
    first = Targets(to.frontend, to.urls[:1], to.model, to.api_key)
    ttfts, itls = [], []
    for i, r in enumerate(reqs):
        done, _ = asyncio.run(replay(first, [r], [0.0], f"{tag}{i}", 300))
        c = done[0]
        if c.error is not None or c.ttft is None:
            raise RuntimeError(f"idle request {tag}{i} failed: {c.error}")
        if i:
            ttfts.append(c.ttft)
            itls += c.itls
    return {"ttft": statistics.median(ttfts), "itl": statistics.median(itls)}

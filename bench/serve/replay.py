"""Load: each request sent at its (seeded Poisson) arrival time over Triton gRPC streaming, round-robin
over a deployment's decode groups, every point bounded in time; and the idle baseline."""

from __future__ import annotations

import asyncio
import statistics
import time

import tritonclient.grpc.aio as aioclient
from tqdm import tqdm

from bench.serve.deploy import decode_urls
from bench.serve.workloads import BenchRequest
from orchestrator.client import Completion, generate
from orchestrator.launch import Launch


async def replay(
    urls: list[str],
    requests: list[BenchRequest],
    arrivals: list[float],
    tag: str,
    max_seconds: float,
    bar: tqdm | None = None,
) -> tuple[list[Completion], float]:
    """Send each request at its arrival time (round-robin over ``urls``); returns them and the wall time."""
    clients = [aioclient.InferenceServerClient(u) for u in urls]
    start = time.monotonic()

    async def one(i: int, req: BenchRequest) -> Completion:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - start)))
        done = await generate(clients[i % len(clients)], req.prompt, req.max_tokens, f"{tag}-{i}", ignore_eos=True)
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


def measure_idle(launch: Launch, reqs: list[BenchRequest], tag: str) -> dict[str, float]:
    """One request at a time: the first warms up, the rest give the idle TTFT and decode step."""
    urls = decode_urls(launch)[:1]
    ttfts, itls = [], []
    for i, r in enumerate(reqs):
        done, _ = asyncio.run(replay(urls, [r], [0.0], f"{tag}{i}", 300))
        c = done[0]
        if c.error is not None or c.ttft is None:
            raise RuntimeError(f"idle request failed on {launch.cfg.mode.value}: {c.error}")
        if i:
            ttfts.append(c.ttft)
            itls += c.itls
    return {"ttft": statistics.median(ttfts), "itl": statistics.median(itls)}

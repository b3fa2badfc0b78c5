"""Start a real deployment (``disagg launch``'s code path: engines, node configs, mpirun, Triton) in a test."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from orchestrator.client import Completion, generate, generate_ids
from orchestrator.cluster import ClusterConfig
from orchestrator.launch import Launch, run_processes
from orchestrator.triton import SHM_DIR, free_port, shm_prefix
from serving.grpc_channel import aio_client


def cluster(tmp: Path, **fields: object) -> ClusterConfig:
    """A cluster config on free ports with the test's engine cache and run dir."""
    http, grpc, metrics = free_port(), free_port(), free_port()
    base = {
        "ports": {"http": http, "grpc": grpc, "metrics": metrics},
        "engine_cache": str(tmp / "engines"),
        "run_dir": str(tmp / "run"),
        "run_dtype": "float32",  # outputs are compared with fp32 engines run in-process
        "timeouts": {"startup_s": 240, "kv_transfer_s": 60, "shutdown_s": 20},
        "router": {"enabled": False},  # tests of the router turn it on (tests/e2e/test_router.py)
    }
    return ClusterConfig.parse(base | fields)


@contextlib.contextmanager
def deployed(cfg: ClusterConfig) -> Iterator[Launch]:
    launch = Launch(cfg)
    launch.prepare(progress=False)
    launch.start()
    try:
        launch.wait_ready()
        assert list(SHM_DIR.glob(f"{shm_prefix(launch.run_id)}*")), "the stubs' shared memory carries the run's prefix"
        yield launch
    finally:
        launch.stop()
        left = run_processes(launch.run_id)
        assert not left, f"processes left behind: {left}"
        leaked = list(SHM_DIR.glob(f"{shm_prefix(launch.run_id)}*"))
        assert not leaked, f"shared memory left behind: {leaked}"


def grpc_url(launch: Launch, decode_group: int = 0) -> str:
    assert launch.prepared is not None
    from torch_engine.config import Role

    leader = next(
        ld for ld in launch.prepared.leaders if ld.slot.role is not Role.PREFILL and ld.slot.group == decode_group
    )
    return f"{launch.cfg.bind}:{leader.ports.grpc}"


def run_ids(
    url: str, prompts: list[list[int]], max_tokens: int, tag: str = "r", key: str | None = None
) -> list[Completion]:
    """Concurrent token-id requests to one decode group's ``decode`` model (``key``: a locked-down
    deployment's secret)."""

    async def go() -> list[Completion]:
        client = aio_client(url)
        try:
            jobs = [generate_ids(client, p, max_tokens, f"{tag}{i}", key=key) for i, p in enumerate(prompts)]
            return list(await asyncio.gather(*jobs))
        finally:
            await client.close()

    return asyncio.run(go())


def run_texts(url: str, prompts: list[str], max_tokens: int) -> list[Completion]:
    """Concurrent streamed text requests to ``llm``."""

    async def go() -> list[Completion]:
        client = aio_client(url)
        try:
            return list(
                await asyncio.gather(*(generate(client, p, max_tokens, f"t{i}") for i, p in enumerate(prompts)))
            )
        finally:
            await client.close()

    return asyncio.run(go())


_HOLDING = re.compile(r"(disagg_queue_depth|disagg_live_records)\{([^}]*)\} ([\d.e+-]+)$")


def wait_busy(launch: Launch, slot_name: str, timeout_s: float = 60.0) -> None:
    """Poll one leader's metrics (``slot_name``: ``decode1.tp0``) until its loop holds a request — waiting or
    running in its engine, or a per-request record (a prefill node's KV job; tombstones of aborted epochs do not
    count) — so that a test kills a group while load is observably in flight, not after a fixed sleep that a
    faster engine outruns (or that ends before the load reached the group)."""
    assert launch.prepared is not None
    port = next(ld.ports.metrics for ld in launch.prepared.leaders if ld.slot.name == slot_name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{launch.cfg.bind}:{port}/metrics", timeout=10) as r:
            found = [_HOLDING.match(line) for line in r.read().decode().splitlines()]
        if any(m and float(m.group(3)) > 0 and 'what="tombstones"' not in m.group(2) for m in found):
            return
        time.sleep(0.01)
    raise AssertionError(f"{slot_name} held no request within {timeout_s:.0f} s")


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket these processes listen on (from /proc: no tools needed)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                address = str(ipaddress.IPv6Address(raw))
            else:
                address = str(ipaddress.IPv4Address(raw[::-1]))
            found.append((inodes[inode], address, int(hex_port, 16)))
    return found

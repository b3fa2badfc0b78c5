"""Memory bandwidth measured in the run that uses it: the copy rate and the read rate (the floor for
reading weights: a decode step reads them, it does not copy them)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    if device == "cpu":
        return fn

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second that ``copy_`` moves between two large buffers (each byte read once, written once)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / _median_time(_synced(lambda: dst.copy_(src), device), repeats)


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second read by a ``sum`` over a large fp32 buffer (the floor for reading weights)."""
    if device != "cpu":
        nbytes = 4 << 30  # GPUs: large enough to leave the caches
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    buf.sum()
    return nbytes / _median_time(_synced(buf.sum, device), repeats)

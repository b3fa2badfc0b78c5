"""Ports on this host: is one free, pick a free one (TP rendezvous, Triton servers).

A port picked now is bound later, by another process (Triton, an MPI rank), so two things can take it in between:

* **the kernel**, which hands ephemeral ports (``bind(..., 0)``, every outgoing ``connect``) from
  ``ip_local_port_range``. ``free_port`` therefore picks *below* that range, where the kernel never hands out
  a port on its own.
* **another picker on this host** (the next test, a rank choosing its rendezvous port). Each port handed out is
  reserved for ``RESERVE_S`` with a marker file created exclusively under the temp directory, so no other
  ``free_port`` call on this host returns it while its owner starts up.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOWEST = 10000
"""The lowest port ``free_port`` hands out."""
RESERVE_S = 600.0
"""How long a port handed out stays reserved against other ``free_port`` calls on this host."""
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)
_SWEEP_AT = 512


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux default when it cannot be read)."""
    try:
        low, high = _EPHEMERAL_RANGE.read_text().split()
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return int(low), int(high)


def candidate_ports() -> range:
    """Ports ``free_port`` picks from: below the ephemeral range, or above it when it starts too low."""
    low, high = ephemeral_range()
    if low - LOWEST >= 1000:
        return range(LOWEST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    raise RuntimeError(
        f"the ephemeral port range {low}-{high} leaves no room for fixed ports: "
        f"narrow net.ipv4.ip_local_port_range to start at {LOWEST + 1000} or above"
    )


def _reservations() -> Path:
    d = Path(tempfile.gettempdir()) / "disagg-ports"
    d.mkdir(exist_ok=True)
    return d


def _sweep(directory: Path, now: float) -> None:
    for marker in directory.iterdir():
        with contextlib.suppress(OSError):
            if now - marker.stat().st_mtime > RESERVE_S:
                marker.unlink()


def _reserve(directory: Path, port: int, now: float) -> bool:
    """Create the port's marker; an expired one is taken over."""
    marker = directory / str(port)
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if now - marker.stat().st_mtime <= RESERVE_S:
                return False
            marker.unlink()
        except OSError:
            return False
        return _reserve(directory, port, now)
    os.close(fd)
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the ephemeral range and reserved against other pickers on this host."""
    ports = candidate_ports()
    directory = _reservations()
    now = time.time()
    if sum(1 for _ in directory.iterdir()) > _SWEEP_AT:
        _sweep(directory, now)
    start = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if port_free(host, port) and _reserve(directory, port, now):
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} on {host}")

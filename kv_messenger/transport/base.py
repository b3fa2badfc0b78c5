"""The transport interface: register memory, exchange agent metadata, one-sided WRITE + notification.

A transport only moves bytes; what to move is the shard plan's business. Local memory is
registered once (``register``); peers are added from the metadata blob they publish
(``metadata`` / ``add_peer``). ``write`` posts a batch of ``(local address, remote address,
length)`` ranges to one peer with one notification that the peer sees (``notifications``) after
all the batch's bytes have landed. Failures are data: ``state`` says DONE / FAILED.
"""

from __future__ import annotations

import enum
import random
import threading
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


class TransferState(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


Range = tuple[int, int, int]  # (local address, remote address, length in bytes)
Ranges = list[Range] | np.ndarray  # or an ``[N, 3]`` uint64 array of the same


class Fault(enum.IntEnum):
    NONE = 0
    DROP = 1  # no bytes, no notification, yet reported DONE (a lost write)
    FAIL = 2  # no bytes, no notification, reported FAILED
    STALL = 3  # PENDING until the test lets it go (in-process transport only): a slow or hung peer


@dataclass(slots=True)
class FaultInjector:
    """Test hook shared by the transports: the next ``n`` writes are dropped, failed or stalled,
    and a ``fail_rate`` share of all writes fail at random (seeded; a deployment's chaos setting)."""

    drop_next: int = 0
    fail_next: int = 0
    stall_next: int = 0
    fail_rate: float = 0.0
    seed: int = 0
    dropped: int = 0
    failed: int = 0
    stalled: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rng: random.Random | None = None

    def next_fault(self) -> Fault:
        with self._lock:
            if self.drop_next > 0:
                self.drop_next -= 1
                self.dropped += 1
                return Fault.DROP
            if self.fail_next > 0:
                self.fail_next -= 1
                self.failed += 1
                return Fault.FAIL
            if self.stall_next > 0:
                self.stall_next -= 1
                self.stalled += 1
                return Fault.STALL
            if self.fail_rate > 0:
                if self._rng is None:
                    self._rng = random.Random(self.seed)
                if self._rng.random() < self.fail_rate:
                    self.failed += 1
                    return Fault.FAIL
            return Fault.NONE


class Transport(Protocol):
    name: str
    faults: FaultInjector

    def register(self, tensors: list[torch.Tensor]) -> None: ...

    def metadata(self) -> bytes: ...

    def add_peer(self, name: str, metadata: bytes) -> None: ...

    def write(self, peer: str, ranges: Ranges, notif: bytes) -> object: ...

    def state(self, handle: object) -> TransferState: ...

    def release(self, handle: object) -> None: ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def notifications(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...

"""The transport interface: register memory, exchange agent metadata, one-sided WRITE + notification.

A transport only moves bytes; what to move is the shard plan's business. Local memory is
registered once (``register``); peers are added from the metadata blob they publish
(``metadata`` / ``add_peer``). ``write`` posts a batch of ``(local address, remote address,
length)`` ranges to one peer with one notification that the peer sees (``notifications``) after
all the batch's bytes have landed. Failures are data: ``state`` says DONE / FAILED.
"""

from __future__ import annotations

import enum
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


@dataclass(slots=True)
class FaultInjector:
    """Test hook shared by the transports: silently drop the next ``n`` transfers (no bytes, no
    notification, yet reported DONE to the sender), as a lost write would look."""

    drop_next: int = 0
    dropped: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def should_drop(self) -> bool:
        with self._lock:
            if self.drop_next > 0:
                self.drop_next -= 1
                self.dropped += 1
                return True
            return False


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

"""In-process transport for unit tests: agents in one process, writes are memcpy between registered tensors."""

from __future__ import annotations

import ctypes
import threading
from collections import deque

import torch

from kv_messenger.transport.base import FaultInjector, Ranges, TransferState


class MemoryFabric:
    """The 'network' that in-process agents share."""

    def __init__(self) -> None:
        self.agents: dict[str, MemoryTransport] = {}
        self.lock = threading.Lock()

    def agent(self, name: str) -> MemoryTransport:
        t = MemoryTransport(name, self)
        with self.lock:
            if name in self.agents:
                raise ValueError(f"agent {name!r} already exists")
            self.agents[name] = t
        return t


class MemoryTransport:
    def __init__(self, name: str, fabric: MemoryFabric) -> None:
        self.name = name
        self.fabric = fabric
        self.faults = FaultInjector()
        self._regions: list[tuple[int, int]] = []
        self._peers: set[str] = set()
        self._inbox: deque[tuple[str, bytes]] = deque()

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError("the in-memory transport only moves CPU memory")
            self._regions.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        if metadata.decode() != name or name not in self.fabric.agents:
            raise ValueError(f"unknown peer {name!r}")
        self._peers.add(name)

    def _check(self, regions: list[tuple[int, int]], addr: int, length: int, who: str) -> None:
        if not any(lo <= addr and addr + length <= hi for lo, hi in regions):
            raise ValueError(f"range {addr:#x}+{length} is outside {who}'s registered memory")

    def write(self, peer: str, ranges: Ranges, notif: bytes) -> TransferState:
        if peer not in self._peers:
            raise ValueError(f"{peer!r} is not a connected peer of {self.name!r}")
        if self.faults.should_drop():
            return TransferState.DONE
        remote = self.fabric.agents[peer]
        for row in ranges:
            src, dst, n = (int(x) for x in row)
            self._check(self._regions, src, n, self.name)
            self._check(remote._regions, dst, n, peer)
            ctypes.memmove(dst, src, n)
        remote._inbox.append((self.name, notif))
        return TransferState.DONE

    def state(self, handle: object) -> TransferState:
        assert isinstance(handle, TransferState)
        return handle

    def release(self, handle: object) -> None:
        return None

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.fabric.agents[peer]._inbox.append((self.name, msg))

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.agents.pop(self.name, None)

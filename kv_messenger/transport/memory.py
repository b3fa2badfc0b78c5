"""In-process transport for unit tests: agents in one process, writes are memcpy between registered tensors."""

from __future__ import annotations

import ctypes
import threading
from collections import deque

import torch

from kv_messenger.transport.base import Fault, FaultInjector, Ranges, TransferState


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


class _Write:
    """One posted write: done at once, or stalled until ``MemoryTransport.release_stalled``."""

    __slots__ = ("notif", "peer", "ranges", "state")

    def __init__(self, peer: str, ranges: list[tuple[int, int, int]], notif: bytes, state: TransferState) -> None:
        self.peer, self.ranges, self.notif, self.state = peer, ranges, notif, state


class MemoryTransport:
    def __init__(self, name: str, fabric: MemoryFabric) -> None:
        self.name = name
        self.fabric = fabric
        self.faults = FaultInjector()
        self._regions: list[tuple[int, int]] = []
        self._peers: set[str] = set()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._stalled: list[_Write] = []

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

    def write(self, peer: str, ranges: Ranges, notif: bytes) -> _Write:
        if peer not in self._peers:
            raise ValueError(f"{peer!r} is not a connected peer of {self.name!r}")
        rows = [(int(r[0]), int(r[1]), int(r[2])) for r in ranges]
        fault = self.faults.next_fault()
        if fault is Fault.DROP:
            return _Write(peer, rows, notif, TransferState.DONE)
        if fault is Fault.FAIL:
            return _Write(peer, rows, notif, TransferState.FAILED)
        w = _Write(peer, rows, notif, TransferState.PENDING)
        if fault is Fault.STALL:
            self._stalled.append(w)
        else:
            self._land(w)
        return w

    def release_stalled(self) -> int:
        """Let every stalled write land now (late); returns how many there were."""
        stalled, self._stalled = self._stalled, []
        for w in stalled:
            if w.state is TransferState.PENDING:  # not cancelled meanwhile
                self._land(w)
        return len(stalled)

    def _land(self, w: _Write) -> None:
        remote = self.fabric.agents.get(w.peer)
        if remote is None:  # the peer is gone
            w.state = TransferState.FAILED
            return
        for src, dst, n in w.ranges:
            self._check(self._regions, src, n, self.name)
            self._check(remote._regions, dst, n, w.peer)
            ctypes.memmove(dst, src, n)
        remote._inbox.append((self.name, w.notif))
        w.state = TransferState.DONE

    def state(self, handle: object) -> TransferState:
        assert isinstance(handle, _Write)
        return handle.state

    def release(self, handle: object) -> None:
        assert isinstance(handle, _Write)
        if handle.state is TransferState.PENDING:  # cancelled: a stalled write never lands
            handle.state = TransferState.FAILED

    def send_notif(self, peer: str, msg: bytes) -> None:
        remote = self.fabric.agents.get(peer)
        if remote is not None:  # a notification to a vanished peer is lost, as on a network
            remote._inbox.append((self.name, msg))

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.agents.pop(self.name, None)

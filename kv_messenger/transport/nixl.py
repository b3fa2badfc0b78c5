"""NIXL transport: UCX by default (RDMA / shared memory / TCP), LIBFABRIC selectable for EFA.

Exercised here: UCX on CPU memory (DRAM) between processes of one machine. Not exercised:
LIBFABRIC (needs EFA hardware), VRAM registration (needs a GPU).

Several threads use one agent: the messenger thread polls it while the serving loop's thread
refuses requests (``send_notif``), connects restarted peers (``add_peer``) and closes it. A UCX
worker is not safe to enter from two threads at once (an unserialised run segfaulted inside
``uct_tcp_iface_progress`` under the reliability soak), so the agent is created in NIXL's strict
thread-safe mode (``NIXL_THREAD_SYNC_STRICT``: the agent serialises its own calls; the default
without a listener thread is ``NONE``), and every call from here also holds this transport's lock,
which covers the Python wrapper's own state (its notification dictionary) between calls.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from kv_messenger.config import NixlBackend
from kv_messenger.transport.base import Fault, FaultInjector, Ranges, TransferState

log = logging.getLogger(__name__)


class NixlTransport:
    def __init__(
        self,
        name: str,
        backend: NixlBackend = NixlBackend.UCX,
        progress_thread: bool = False,
        faults: FaultInjector | None = None,
    ) -> None:
        backend = NixlBackend(backend)  # a plain string names a backend too; unknown ones are a ValueError
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise RuntimeError("NIXL with thread-sync modes is not installed: pip install 'nixl-cu12>=1.5'") from exc
        self.name = name
        self.faults = faults or FaultInjector()
        sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT  # see the module docstring
        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend.value], sync_mode=sync)
        self.sync_mode = sync.name
        self._agent = nixl_agent(name, conf)
        self._mem_type = "DRAM"
        self._registered: list[object] = []
        self._done = object()  # handle of a transfer the fault injector dropped
        self._failed = object()  # handle of a transfer the fault injector failed
        self._lock = threading.RLock()  # one thread inside the agent at a time (see the module docstring)

    def register(self, tensors: list[torch.Tensor]) -> None:
        if any(t.device.type == "cuda" for t in tensors):
            self._mem_type = "VRAM"
        with self._lock:
            self._registered.append(self._agent.register_memory(tensors))

    def metadata(self) -> bytes:
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, name: str, metadata: bytes) -> None:
        with self._lock:
            added = self._agent.add_remote_agent(metadata)
        if isinstance(added, bytes):
            added = added.decode()
        if added != name:
            raise ValueError(f"peer metadata names agent {added!r}, expected {name!r}")

    def _descs(self, pairs: np.ndarray) -> object:
        with self._lock:
            return self._agent.get_xfer_descs(pairs, self._mem_type)

    def write(self, peer: str, ranges: Ranges, notif: bytes) -> object:
        fault = self.faults.next_fault()
        if fault is Fault.DROP:
            return self._done
        if fault is Fault.FAIL:
            return self._failed
        arr = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3)
        dev = np.zeros(len(arr), dtype=np.uint64)
        local = self._descs(np.stack([arr[:, 0], arr[:, 2], dev], axis=1))
        remote = self._descs(np.stack([arr[:, 1], arr[:, 2], dev], axis=1))
        handle, why = None, None
        try:
            with self._lock:
                handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
                posted = self._agent.transfer(handle)
        except Exception as exc:  # NIXL raises its own types (a dead peer: NIXL_ERR_REMOTE_DISCONNECT)
            posted, why = "ERR", repr(exc)
        if posted == "ERR":  # this write failed, not the sender: its job fails, the other peers are served
            log.warning("a KV write to %s failed: %s", peer, why or "NIXL could not post it")
            if handle is not None:
                self.release(handle)
            return self._failed
        return handle

    def state(self, handle: object) -> TransferState:
        if handle is self._done:
            return TransferState.DONE
        if handle is self._failed:
            return TransferState.FAILED
        try:
            with self._lock:
                s = self._agent.check_xfer_state(handle)  # type: ignore[arg-type]  # our handles are NIXL's
        except Exception as exc:  # NIXL's own error types: the peer went away mid-write
            log.warning("a KV write failed: %s", exc)
            return TransferState.FAILED
        return {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}.get(s, TransferState.FAILED)

    def release(self, handle: object) -> None:
        if handle is not self._done and handle is not self._failed:
            try:
                with self._lock:
                    self._agent.release_xfer_handle(handle)  # type: ignore[arg-type]
            except Exception as exc:  # NIXL's own error types: releasing a dead peer's write
                log.warning("releasing a KV write failed: %s", exc)

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            with self._lock:
                self._agent.send_notif(peer, msg)
        except Exception as exc:  # NIXL raises its own error types; a dead peer must not kill the sender
            log.warning("notification to %s lost: %s", peer, exc)

    def notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            new = self._agent.get_new_notifs()
        return [(peer, m) for peer, msgs in new.items() for m in msgs]

    def close(self) -> None:
        with self._lock:
            for reg in self._registered:
                self._agent.deregister_memory(reg)
            self._registered.clear()

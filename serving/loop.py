"""The loop base of a serving node: an engine driven from its own thread.

A node never blocks its server (the Triton stub) on the engine: callers put work into an inbox
and return at once; the loop thread takes it out, runs one *pass* after another, and stops when
asked. Two kinds exist: ``DecodeLoop`` (decode / colocated nodes) and ``PrefillLoop`` (prefill
nodes). Each pass:

    inbox ──admit(item)──> the engine (or its connector)
    pass  ──one engine step, or a poll of the transfers in flight──> deliveries
    stop  ──the thread ends; ``on_exit`` runs on it (TP groups release their followers there:
            collectives belong to this thread)

If a pass raises (a bug or a dead peer), ``fail_all`` runs before the thread ends, so that no
request waits on a loop that is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")


class ServingLoop(ABC, Generic[ItemT]):
    """Subclasses implement ``_admit`` (one inbox item), ``_busy`` (engine work pending: do not
    sleep on the inbox), ``_wait_s`` (how long an idle pass waits for input), ``_work`` (the rest of
    a pass) and optionally ``_fail_all``; they call ``_start`` at the end of their ``__init__``."""

    name = "serving-loop"

    def __init__(self, on_exit: Callable[[], None] | None = None) -> None:
        self.on_exit = on_exit
        self._inbox: queue.Queue[ItemT] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _put(self, item: ItemT) -> None:
        self._inbox.put(item)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the loop; False if it did not end in time (it is a daemon thread: the process can exit)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the %s thread did not stop within %.0f s", self.name, timeout_s)
            return False
        return True

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                self._work()
        except Exception as exc:  # a bug or a dead peer: no request may hang on a loop that is gone
            log.exception("the %s stopped", self.name)
            self._fail_all(f"{self.name} stopped: {exc}")
            raise
        finally:
            if self.on_exit is not None:
                self.on_exit()

    def _drain(self) -> None:
        """Admit everything in the inbox; wait for the first item only when there is nothing to do."""
        timeout: float | None = None if self._busy() else self._wait_s()
        try:
            while True:
                self._admit(self._inbox.get(block=timeout is not None, timeout=timeout))
                timeout = None
        except queue.Empty:
            pass

    # -- what a kind of loop does --------------------------------------------------------
    @abstractmethod
    def _admit(self, item: ItemT) -> None: ...

    @abstractmethod
    def _busy(self) -> bool: ...

    @abstractmethod
    def _wait_s(self) -> float: ...

    @abstractmethod
    def _work(self) -> None: ...

    def _fail_all(self, error: str) -> None:
        del error  # nothing held by default

"""The loop base of a serving node: an engine driven from its own thread.

A node never blocks its server (the Triton stub) on the engine: callers put work into an inbox
and return at once; the loop thread takes it out, runs one *pass* after another, and stops when
asked. Two kinds exist: ``DecodeLoop`` (decode / colocated nodes) and ``PrefillLoop`` (prefill
nodes). Each pass:

    inbox ──admit(item)──> the engine (or its connector)
    pass  ──one engine step, or a poll of the transfers in flight──> deliveries
    stop  ──the thread ends; ``on_exit`` runs on it (TP groups release their followers there:
            collectives belong to this thread)

If a pass raises (a bug, a dead peer, a TP collective that timed out), ``fail_all`` runs before
the thread ends, so that no request waits on a loop that is gone, then ``on_fatal`` (servers make
the process exit there: a node without its loop must not look alive to its supervisor).

A loop that has not finished a pass for ``stall_s`` (a step that never returns: a wedged kernel,
a peer that holds a collective) is wedged, not slow: a watchdog thread logs the loop thread's
stack and calls ``on_fatal`` with ``LoopStalled``, so that the process ends and its supervisor
restarts the group instead of leaving a node that answers probes but serves nothing.
``stalled_s()`` (any thread) is how long the current pass has run, ``longest_step_s()`` the longest
of the last ``STEP_WINDOW`` passes that stepped the engine; routers read both with every probe and
take a group whose loop has been in one pass far longer than its steps take out of rotation long
before the watchdog fires.

``on_report`` gets a ``LoopReport`` (pages, queues, and how many per-request records each
structure holds) after every pass that stepped the engine and at least every
``report_interval_s`` otherwise, so gauges return to their idle values when the node goes idle.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from torch_engine.pages import PageStats
from torch_engine.prefix_cache import NO_CACHE, CacheEvents, CacheStats

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")

STEP_WINDOW = 256  # passes that stepped the engine, of which ``longest_step_s`` is the longest


@dataclass(frozen=True, slots=True)
class LoopReport:
    pages: PageStats
    waiting: int
    running: int
    records: dict[str, int]  # per-request records held, by structure: all 0 on an idle node (bounded state)
    drafts: tuple[int, int] = (0, 0)  # speculative draft tokens so far: (proposed, accepted)
    prefills: tuple[int, int] = (0, 0)  # disaggregated decode nodes: prompts prefilled (here, at a prefill group)
    cache: CacheStats = NO_CACHE  # this node's prefix cache: pages, tokens looked up, tokens found
    cache_events: CacheEvents | None = None  # its events since the last report (``serving.kv_events``)


ReportHook = Callable[[LoopReport], None]


class LoopStalled(RuntimeError):
    """The loop did not finish a pass within its ``stall_s``."""


class ServingLoop(ABC, Generic[ItemT]):
    """Subclasses implement ``_admit`` (one inbox item), ``_busy`` (engine work pending: do not
    sleep on the inbox), ``_wait_s`` (how long an idle pass waits for input), ``_work`` (the rest of
    a pass) and optionally ``_fail_all``; they call ``_start`` at the end of their ``__init__``."""

    name = "serving-loop"

    report_interval_s = 0.25

    def __init__(
        self,
        on_exit: Callable[[], None] | None = None,
        on_report: ReportHook | None = None,
        stall_s: float | None = None,
    ) -> None:
        self.on_exit = on_exit
        self.on_report = on_report
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.stall_s = stall_s  # None: no watchdog
        self._stepped = False  # the last pass ran an engine step (set by subclasses)
        self._reported_at = 0.0
        self._pass_ended = time.monotonic()
        self._steps = [0.0] * STEP_WINDOW  # durations of the last passes that stepped (a ring: any thread reads)
        self._step_at = 0
        self._inbox: queue.Queue[ItemT] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"{self.name}-watchdog", daemon=True)

    def _start(self) -> None:
        self._pass_ended = time.monotonic()
        self._thread.start()
        if self.stall_s is not None:
            self._watchdog.start()

    def stalled_s(self) -> float:
        """How long the pass in progress has run (any thread; an idle loop passes every few ms)."""
        if not self._thread.is_alive():
            return 0.0
        return max(time.monotonic() - self._pass_ended, 0.0)

    def longest_step_s(self) -> float:
        """The longest of the last ``STEP_WINDOW`` passes that stepped the engine (any thread)."""
        return max(self._steps)

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
                self._maybe_report()
                ended = time.monotonic()
                if self._stepped:
                    self._steps[self._step_at] = ended - self._pass_ended
                    self._step_at = (self._step_at + 1) % STEP_WINDOW
                self._pass_ended = ended
        except Exception as exc:  # a bug or a dead peer: no request may hang on a loop that is gone
            log.exception("the %s stopped", self.name)
            self._fail_all(f"{self.name} stopped: {exc}")
            if self.on_fatal is not None:
                self.on_fatal(exc)
            raise
        finally:
            if self.on_exit is not None:
                self.on_exit()

    def _watch(self) -> None:
        assert self.stall_s is not None
        while not self._stop.wait(min(1.0, self.stall_s / 4)):
            stalled = self.stalled_s()
            if stalled <= self.stall_s:
                continue
            frame = sys._current_frames().get(self._thread.ident or -1)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
            log.error("the %s has not finished a pass for %.0f s; it is at:\n%s", self.name, stalled, where)
            if self.on_fatal is not None:
                self.on_fatal(LoopStalled(f"the {self.name} has not finished a pass for {stalled:.0f} s"))
            return

    def _drain(self) -> None:
        """Admit everything in the inbox; wait for the first item only when there is nothing to do."""
        timeout: float | None = None if self._busy() else self._wait_s()
        try:
            while True:
                self._admit(self._inbox.get(block=timeout is not None, timeout=timeout))
                timeout = None
        except queue.Empty:
            pass

    def _maybe_report(self) -> None:
        if self.on_report is None:
            return
        now = time.monotonic()
        if self._stepped or now - self._reported_at >= self.report_interval_s:
            self._stepped, self._reported_at = False, now
            self.on_report(self.report())

    # -- what a kind of loop does --------------------------------------------------------
    @abstractmethod
    def report(self) -> LoopReport:
        """The node's state now (called on the loop thread)."""

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

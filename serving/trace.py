"""Per-request server-side timestamps, one JSON line per request (for the serving benchmark).

Decode nodes mark ``arrived`` / ``sent`` / ``kv_ready`` / ``scheduled`` / ``first_token`` /
``finished`` (and ``moved`` with ``moves`` when a failed prefill group's request went to another);
prefill nodes mark ``received`` / ``scheduled`` / ``prefilled`` / ``kv_sent``
(``scheduled``: the first engine step the request takes part in). Times are wall-clock seconds
(``time.time()``) so that lines written by different processes can be joined by request id.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from torch_engine.scheduler import SchedulerOutput


class Tracer:
    def __init__(self, path: Path, node: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.node = node
        self._open: dict[str, dict[str, object]] = {}
        self._lock = threading.Lock()

    def mark(self, request_id: str, event: str, **fields: object) -> None:
        with self._lock:
            rec = self._open.setdefault(request_id, {"request_id": request_id, "node": self.node})
            rec.setdefault(event, time.time())
            rec.update(fields)

    def finish(self, request_id: str, event: str = "finished", **fields: object) -> None:
        """Mark the last event and write the request's line."""
        self.mark(request_id, event, **fields)
        self.close(request_id, event)

    def close(self, request_id: str, event: str, **fields: object) -> None:
        """Mark the last event and write the line of a request that has a record open (nothing when it
        has none: one that ended early, failed or aborted, may be closed twice)."""
        with self._lock:
            rec = self._open.pop(request_id, None)
            if rec is None:
                return
            rec.setdefault(event, time.time())
            rec.update(fields)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def open_records(self) -> int:
        """Requests with a record not yet written (bounded state: 0 on an idle node)."""
        with self._lock:
            return len(self._open)


def read_trace(path: Path) -> list[dict[str, object]]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class TraceObserver:
    """Engine step observer: marks ``scheduled`` the first time a request runs in a step."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._seen: set[str] = set()

    def before_step(self, sched: SchedulerOutput) -> None:
        for c in sched.chunks:
            rid = c.request.request_id
            if rid not in self._seen:
                self._seen.add(rid)
                self.tracer.mark(rid, "scheduled")
        if len(self._seen) > 100_000:  # ids of long-finished requests
            self._seen.clear()

    def after_forward(self, sched: SchedulerOutput) -> None:
        pass

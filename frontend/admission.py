"""The router's front gate: overload is shed, not absorbed.

At most ``max_in_flight`` requests are served at once (a streamed one holds its slot until its
last chunk); up to ``max_queued`` more wait, at most ``queue_timeout_s`` each: first come first
served while the queue drains quickly, newest first once it stands (adaptive LIFO: when the oldest
waiter has waited half the timeout, a freed slot goes to the newest one, which has the most time
left: under sustained overload the served requests then wait little, while the old ones get their
503 at their deadline as before, instead of every served one having waited nearly the timeout); one
client (its address) holds at most ``max_per_client`` of the slots and queue places.
Anything past that is answered at once: 429 ``rate_limit_exceeded`` with ``Retry-After`` (queue
full, or the client's own limit), 503 with ``Retry-After`` when the wait ran out. A slot is handed
from the request that ends straight to a waiter, so the count never overshoots.

States of a request here: arriving ──(a free slot, nobody waiting)──> serving
                                  └──(room in the queue)──> queued ──(handed a slot)──> serving
                                                                   └──(timeout / cancel)──> gone
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from frontend.generation import ApiError


class Admission:
    def __init__(
        self, max_in_flight: int, max_queued: int, queue_timeout_s: float, max_per_client: int | None = None
    ) -> None:
        self.max_in_flight, self.max_queued = max_in_flight, max_queued
        self.queue_timeout_s, self.max_per_client = queue_timeout_s, max_per_client
        self.in_flight = 0
        self._waiters: deque[tuple[asyncio.Future[None], float]] = deque()  # (waiter, when it came)
        self._clients: dict[str, int] = {}  # client -> its requests serving or queued

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def clients(self) -> int:
        """Clients with a request here (bounded state: a client with none is forgotten)."""
        return len(self._clients)

    @contextlib.asynccontextmanager
    async def slot(self, client: str) -> AsyncIterator[None]:
        """Hold one of the slots while the body runs (ApiError 429 / 503 when none can be had)."""
        held = self._clients.get(client, 0)
        if self.max_per_client is not None and held >= self.max_per_client:
            raise ApiError(
                429, f"this client already has {held} requests in flight (the limit is {self.max_per_client})",
                "rate_limit_exceeded", code="rate_limit_exceeded", retry_after=1.0,
            )  # fmt: skip
        self._clients[client] = held + 1
        try:
            await self._acquire()
            try:
                yield
            finally:
                self._release()
        finally:
            left = self._clients[client] - 1
            if left:
                self._clients[client] = left
            else:
                del self._clients[client]

    async def _acquire(self) -> None:
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise ApiError(
                429, f"the router is at capacity ({self.in_flight} requests in flight, {len(self._waiters)} queued)",
                "rate_limit_exceeded", code="rate_limit_exceeded", retry_after=1.0,
            )  # fmt: skip
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (waiter, time.monotonic())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot was handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ApiError(
                503, f"no slot freed within {self.queue_timeout_s:g} s ({self.in_flight} requests in flight)",
                "server_error", code="overloaded", retry_after=self.queue_timeout_s,
            ) from None  # fmt: skip

    def _release(self) -> None:
        while self._waiters:
            standing = time.monotonic() - self._waiters[0][1] >= self.queue_timeout_s / 2
            waiter, _ = self._waiters.pop() if standing else self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot goes straight to it
                return
        self.in_flight -= 1

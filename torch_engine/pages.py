"""The page allocator: who holds which KV page, which pages are pinned, which keep a cached prefix.

A page is in one of three places:

    free     ──allocate──> held (refs >= 1) ──free, last holder──> free       (no cached content)
    cached ──share (a prefix hit)──> held                 held ──free, last holder──> cached
    cached ──evicted (allocate found no free page; or over ``max_cached``)──> free

``refs`` counts the requests that hold a page (a prefix page is shared by every request that
matched it); ``pins`` count transfers that read or write it. A held page whose last holder lets
go while pins remain is *pending*: it goes to ``free`` / ``cached`` only at its last unpin, so a
page a transfer may still touch is never handed out again, cached or not. A page becomes
*cached* (``mark_cached``, by the prefix cache) once its content is complete and final; a cached
page is never written again while it exists (its holders only read it). Cached pages with no
holder form an LRU (oldest evicted first); a request's pages enter it tail first, so the leaves
of a prefix chain go before the pages they extend. ``free`` / ``can_allocate`` count cached pages
as available: they are taken back when the pool needs them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

EvictHook = Callable[[int], None]  # a cached page was evicted: its content is gone


class OutOfPagesError(RuntimeError):
    """Raised by ``allocate`` when the pool cannot satisfy a request (call ``can_allocate`` first)."""


@dataclass(frozen=True, slots=True)
class PageStats:
    total: int
    free: int  # allocatable now: free pages and cached pages nobody holds
    used: int  # held (or pending: released while a transfer still pins them)
    pinned: int
    cached: int = 0  # of ``free``: pages that keep a cached prefix until they are needed


class PageAllocator:
    """Free list, reference counts, pin counts, deferred release and the LRU of cached pages."""

    def __init__(self, num_pages: int, max_cached: int | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.max_cached = num_pages if max_cached is None else max_cached
        self.on_evict: EvictHook | None = None
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self._refs = [0] * num_pages
        self._pins = [0] * num_pages
        self._pending = [False] * num_pages  # no holder left, but pinned
        self._cached = [False] * num_pages

    # -- handing pages out ---------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free) + len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (evicting the oldest unheld cached pages when the free list runs out)."""
        if not self.can_allocate(n):
            raise OutOfPagesError(f"need {n} pages, {len(self._free) + len(self._lru)} of {self.num_pages} are free")
        while len(self._free) < n:
            self._evict(next(iter(self._lru)))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def revivals(self, pages: Iterable[int]) -> int:
        """How many of ``pages`` (cached) sit unheld in the LRU: sharing them takes that many off ``free``."""
        return sum(1 for p in pages if p in self._lru)

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each cached (or held) page: a prefix hit."""
        for p in pages:
            self._check(p, "share")
            if self._refs[p]:
                self._refs[p] += 1
            elif p in self._lru:
                del self._lru[p]
                self._refs[p] = 1
            elif self._pending[p] and self._cached[p]:  # unheld but still pinned by a transfer: held again
                self._pending[p] = False
                self._refs[p] = 1
            else:
                raise ValueError(f"cannot share page {p}: it is neither held nor cached")

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; a page nobody holds goes back (to the cached LRU if it
        keeps a prefix), or, while pinned, at its last unpin."""
        cached: list[int] = []
        for p in pages:
            self._check_held(p, "free")
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            if self._pins[p]:
                self._pending[p] = True
            elif self._cached[p]:
                cached.append(p)
            else:
                self._free.append(p)
        for p in reversed(cached):  # tail first: the leaves of a chain are the oldest
            self._to_lru(p)

    # -- transfers -----------------------------------------------------------------------
    def pin(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p, "pin")
            if self._pending[p]:
                raise ValueError(f"page {p} was freed and cannot be pinned again")
            self._check_held(p, "pin")
            self._pins[p] += 1

    def unpin(self, pages: list[int]) -> None:
        for p in pages:
            self._check(p, "unpin")
            if self._pins[p] == 0:
                raise ValueError(f"page {p} is not pinned")
            self._pins[p] -= 1
            if self._pins[p] == 0 and self._pending[p]:
                self._pending[p] = False
                if self._cached[p]:
                    self._to_lru(p)
                else:
                    self._free.append(p)

    def is_pinned(self, page: int) -> bool:
        return self._pins[page] > 0

    # -- the prefix cache's marks --------------------------------------------------------
    def mark_cached(self, page: int) -> None:
        """``page`` (held) now keeps a cached prefix: when nobody holds it, it stays until evicted."""
        self._check_held(page, "cache")
        self._cached[page] = True

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def refs(self, page: int) -> int:
        return self._refs[page]

    def evict_all(self) -> int:
        """Drop every cached page nobody holds (returns how many)."""
        n = len(self._lru)
        while self._lru:
            self._evict(next(iter(self._lru)))
        return n

    def stats(self) -> PageStats:
        free = len(self._free) + len(self._lru)
        pinned = sum(1 for c in self._pins if c)
        return PageStats(self.num_pages, free, self.num_pages - free, pinned, len(self._lru))

    # -- internals -----------------------------------------------------------------------
    def _to_lru(self, p: int) -> None:
        self._lru[p] = None
        while len(self._lru) > self.max_cached:
            self._evict(next(iter(self._lru)))

    def _evict(self, p: int) -> None:
        del self._lru[p]
        self._cached[p] = False
        self._free.append(p)
        if self.on_evict is not None:
            self.on_evict(p)

    def _check(self, p: int, what: str) -> None:
        if not 0 <= p < self.num_pages:
            raise ValueError(f"cannot {what} page {p}: the pool has pages 0..{self.num_pages - 1}")

    def _check_held(self, p: int, what: str) -> None:
        self._check(p, what)
        if self._refs[p] == 0:
            if self._pending[p]:
                raise ValueError(f"cannot {what} page {p}: it is already being freed")
            raise ValueError(f"cannot {what} page {p}: it is not allocated")

"""Page allocator: accounting, pin / unpin, deferred free, and misuse errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_engine.pages import OutOfPagesError, PageAllocator


def test_allocate_free_accounting() -> None:
    a = PageAllocator(8)
    pages = a.allocate(5)
    assert len(set(pages)) == 5
    assert (a.stats().free, a.stats().used) == (3, 5)
    assert not a.can_allocate(4)
    with pytest.raises(OutOfPagesError, match="need 4 pages, 3 of 8 are free"):
        a.allocate(4)
    a.free(pages)
    assert a.stats().free == 8


def test_pinned_pages_are_freed_on_last_unpin() -> None:
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.pin(pages)
    a.pin(pages[:1])
    assert a.stats().pinned == 2
    a.free(pages)
    assert a.stats().used == 2  # still targeted by a transfer
    a.unpin(pages)
    assert a.stats().used == 1  # page 0 still has one pin
    a.unpin(pages[:1])
    assert a.stats().used == 0 and a.stats().pinned == 0


def test_misuse_is_an_error() -> None:
    a = PageAllocator(4)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([1])
    with pytest.raises(ValueError, match=r"pages 0\.\.3"):
        a.pin([9])
    (p,) = a.allocate(1)
    with pytest.raises(ValueError, match="not pinned"):
        a.unpin([p])
    a.pin([p])
    a.free([p])
    with pytest.raises(ValueError, match="already being freed"):
        a.free([p])
    with pytest.raises(ValueError, match="cannot be pinned again"):
        a.pin([p])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "pin", "unpin"]), st.integers(0, 5)), max_size=80))
def test_random_operations_keep_invariants(ops: list[tuple[str, int]]) -> None:
    a = PageAllocator(16)
    held: list[list[int]] = []
    pinned: list[list[int]] = []
    for op, n in ops:
        if op == "alloc" and a.can_allocate(n):
            held.append(a.allocate(n))
        elif op == "free" and held:
            a.free(held.pop(n % len(held)))
        elif op == "pin" and held:
            group = held[n % len(held)]
            a.pin(group)
            pinned.append(group)
        elif op == "unpin" and pinned:
            a.unpin(pinned.pop(n % len(pinned)))
        s = a.stats()
        assert s.free + s.used == s.total
        live = {p for g in held for p in g}
        assert len(live) == sum(len(g) for g in held)  # no page handed out twice
    for g in pinned:
        a.unpin(g)
    for g in held:
        a.free(g)
    assert a.stats().used == 0

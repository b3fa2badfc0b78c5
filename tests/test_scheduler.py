"""The colocated scheduler's waiting queue: a prompt refused pages for its next chunk does not hold
the ones behind it that fit, until it has waited ``head_of_line_steps``; then nothing passes it."""

from __future__ import annotations

from torch_engine.pages import PageAllocator
from torch_engine.request import FinishReason, Request, RequestKind, RequestState
from torch_engine.sampling import SamplerState, SamplingParams
from torch_engine.scheduler import BYPASS_SCAN, Scheduler

PAGE = 4


def request(name: str, prompt_tokens: int) -> Request:
    return Request(
        request_id=name, prompt_ids=list(range(1, prompt_tokens + 1)), params=SamplingParams(max_tokens=4),
        kind=RequestKind.GENERATE, sampler=SamplerState.seeded(0),
    )  # fmt: skip


def scheduler(pages: int, head_of_line_steps: int) -> Scheduler:
    return Scheduler(PageAllocator(pages), PAGE, 8, 64, 64, head_of_line_steps=head_of_line_steps)


def admitted(s: Scheduler) -> list[str]:
    """One step, computed as the engine would (a chunk that completes samples a token); the requests
    it admitted from the waiting queue."""
    chunks = s.schedule().chunks
    for c in chunks:
        c.request.num_computed = c.start + c.length
        if c.samples:
            c.request.output_ids.append(7)
    return [c.request.request_id for c in chunks if c.start == 0]


def hog(s: Scheduler, pages: int) -> Request:
    """A running, decoding request holding ``pages`` pages (room for its next few tokens in them)."""
    r = request("hog", pages * PAGE - 3)
    s.add(r)
    assert admitted(s) == ["hog"]
    return r


def test_small_prompts_pass_a_big_one_that_cannot_get_pages() -> None:
    s = scheduler(pages=16, head_of_line_steps=3)
    hog(s, 10)  # 6 pages free
    big, small = request("big", 40), request("small", 8)  # 10 pages, 2 pages
    s.add(big)
    s.add(small)
    assert admitted(s) == ["small"]
    assert [r.request_id for r in s.waiting] == ["big"] and big.state is RequestState.WAITING


def test_after_head_of_line_steps_nothing_passes_it_and_it_starts_when_pages_return() -> None:
    s = scheduler(pages=16, head_of_line_steps=3)
    holder = hog(s, 10)
    big = request("big", 40)
    s.add(big)
    for _ in range(3):  # refused pages for three steps: still passable
        assert admitted(s) == []
    late = request("late", 4)
    s.add(late)
    assert admitted(s) == []  # big has waited its steps: late waits behind it
    s.finish(holder, RequestState.FINISHED, FinishReason.STOP)
    assert admitted(s) == ["big", "late"]
    assert not s.waiting and s._blocked_since == {}


def test_zero_steps_is_strict_arrival_order() -> None:
    s = scheduler(pages=16, head_of_line_steps=0)
    hog(s, 10)
    s.add(request("big", 40))
    s.add(request("small", 8))
    assert admitted(s) == []
    assert [r.request_id for r in s.waiting] == ["big", "small"]


def test_at_most_bypass_scan_blocked_requests_are_looked_past() -> None:
    s = scheduler(pages=16, head_of_line_steps=100)
    hog(s, 10)
    for i in range(BYPASS_SCAN + 1):
        s.add(request(f"big{i}", 40))
    s.add(request("small", 4))
    assert admitted(s) == []  # five blocked ones ahead of it: the scan stops
    s.finish(s.waiting[0], RequestState.ABORTED, FinishReason.ABORT)
    assert admitted(s) == ["small"]  # four ahead: passed
    assert "big0" not in s._blocked_since  # a request that left the queue leaves no record

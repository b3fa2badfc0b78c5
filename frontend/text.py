"""Token windows -> text for one request, with stop strings cut exactly.

``window_text`` is the rule the engine loop applies (and ``decode``'s ``text_output``). A stop string may
arrive split over several pieces, so text that could still be the start of one is held back
until it cannot (or the request ends); the text returned never contains a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch_engine.tokenizer import Tokenizer, window_text


def overlap(text: str, stop: str) -> int:
    """The longest ``k < len(stop)`` with ``text`` ending in ``stop[:k]`` (what could still become
    ``stop``), in time linear in ``len(stop)`` (Knuth-Morris-Pratt's prefix function over
    ``stop[:-1]``, a separator, and the tail of ``text`` that could matter)."""
    if len(stop) < 2 or not text:
        return 0
    head = stop[:-1]
    s = [*head, None, *text[-len(head) :]]
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + 1 if s[i] == s[k] else 0
    return pi[-1]


@dataclass(slots=True)
class StopCutter:
    stops: tuple[str, ...]
    held: str = ""
    hit: bool = False

    def feed(self, text: str) -> str:
        if self.hit:
            return ""
        s = self.held + text
        found = [s.index(x) for x in self.stops if x in s]
        if found:
            self.hit, self.held = True, ""
            return s[: min(found)]
        keep = max((overlap(s, x) for x in self.stops), default=0)
        self.held = s[len(s) - keep :]
        return s[: len(s) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


@dataclass(slots=True)
class TextAssembler:
    """Pieces in, new text out; ``text`` is everything so far."""

    tokenizer: Tokenizer
    cutter: StopCutter
    parts: list[str] = field(default_factory=list)

    def push(self, window: tuple[int, ...], skip: int) -> str:
        return self._out(self.cutter.feed(window_text(self.tokenizer, list(window), skip)))

    def finish(self) -> str:
        return self._out(self.cutter.flush())

    def _out(self, piece: str) -> str:
        if piece:
            self.parts.append(piece)
        return piece

    @property
    def text(self) -> str:
        return "".join(self.parts)

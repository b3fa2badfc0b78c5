"""Which prefill group takes a request: the one with the fewest outstanding prefill tokens.

A decode leader knows exactly what it sent itself and not yet got back (``own``), and learns the
whole load of a group from each prefill response (``load_tokens``: every decoder's outstanding
tokens there, this request included). The estimate of a group is its own part plus the others'
part as of the last report; groups that failed a call sit out for ``cooldown_s``, groups that
died (their registry record was withdrawn) until they ``rejoin``. Ties go to the lowest group
index, so the choice is deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Set
from dataclasses import dataclass, field


class NoPrefillGroup(RuntimeError):
    pass


@dataclass(slots=True)
class _Group:
    own: int = 0  # tokens this decoder sent here that have not come back
    others: int = 0  # other decoders' outstanding tokens, as of the last report
    down_until: float = 0.0
    gone: bool = False  # its record left the registry (the group died): out of rotation until it rejoins
    requests: dict[str, int] = field(default_factory=dict)


class Router:
    def __init__(self, num_groups: int, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if num_groups < 1:
            raise ValueError("a router needs at least one prefill group")
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._groups = [_Group() for _ in range(num_groups)]

    def load(self, group: int) -> int:
        g = self._groups[group]
        return g.own + g.others

    def available(self, group: int) -> bool:
        """In rotation now (not cooling down, not gone)."""
        g = self._groups[group]
        return g.down_until <= self.clock() and not g.gone

    def pick(self, exclude: Set[int] = frozenset()) -> int:
        healthy = [i for i in range(len(self._groups)) if i not in exclude and self.available(i)]
        if not healthy:
            tried = ", ".join(str(i) for i in sorted(exclude)) or "none"
            raise NoPrefillGroup(f"no prefill group can take the request (tried: {tried}; others down)")
        return min(healthy, key=lambda i: (self.load(i), i))

    def sent(self, group: int, request_id: str, tokens: int) -> None:
        g = self._groups[group]
        g.requests[request_id] = tokens
        g.own += tokens

    def reported(self, group: int, load_tokens: int) -> None:
        """A response from ``group`` said it holds ``load_tokens`` outstanding tokens in all."""
        g = self._groups[group]
        g.others = max(0, load_tokens - g.own)

    def finished(self, group: int, request_id: str) -> None:
        """The request's KV arrived, or it failed: its tokens are no longer outstanding there."""
        g = self._groups[group]
        g.own -= g.requests.pop(request_id, 0)

    def leave(self, group: int) -> None:
        """The group died: no request goes there until ``rejoin``."""
        self._groups[group].gone = True

    def rejoin(self, group: int) -> None:
        """The group is up again (a new generation): back in rotation, its old load forgotten."""
        g = self._groups[group]
        g.gone, g.down_until, g.others = False, 0.0, 0

    def failed(self, group: int, request_id: str) -> None:
        """A call to ``group`` failed: it sits out a while."""
        self.finished(group, request_id)
        self._groups[group].down_until = self.clock() + self.cooldown_s

"""Engine request ids on a decode node: unique on the node, across the nodes a request travels to,
and across restarts of the node."""

from __future__ import annotations

import itertools
import secrets


class RequestIds:
    """Engine request ids on one decode node: ``CLIENT#N.NODE-BOOT``. Clients may send the same id
    (or none); the counter makes ids unique on the node, the node's name and a random boot tag make
    them unique across the nodes they travel to (prefill groups key their jobs by them) and across
    restarts of the node."""

    def __init__(self, node: str) -> None:
        self._tag = f"{node}-{secrets.token_hex(3)}"
        self._n = itertools.count()

    def next(self, client: str = "") -> str:
        return f"{client or 'triton'}#{next(self._n)}.{self._tag}"

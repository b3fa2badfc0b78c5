"""The router without a deployment: decode groups replaced by fake upstream streams (``Script``: what
a group answers), served by the real aiohttp app."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from frontend.groups import GroupPool
from frontend.upstream import Piece
from torch_engine.sampling import SamplingParams

Script = Callable[[str, list[int], SamplingParams], AsyncGenerator[Piece, None]]


class ScriptedPool(GroupPool):
    """Groups that are all up; nothing is probed or connected."""

    def open(self) -> None:
        for g in self.groups:
            g.client = cast(Any, g.name)  # the fake stream gets the group's name as its "client"
            g.up = True

    async def probe(self, timeout_s: float) -> None:
        return None

    async def close(self) -> None:
        return None


async def healthy(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    tokens = [ids[-1]] * s.max_tokens  # repeats the prompt's last token
    for i in range(1, len(tokens) + 1):
        yield Piece(tuple(tokens[:i]), i - 1, i, "length" if i == len(tokens) else "")

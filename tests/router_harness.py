"""The router without a deployment: decode groups replaced by fake upstream streams (``Script``: what
a group answers), served by the real aiohttp app."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from frontend import generation
from frontend.config import GroupEndpoint, RouterConfig, RouterSpec
from frontend.groups import GroupPool
from frontend.server import Router
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


def scripted_router(
    engine_dir: Path, scripts: dict[str, Script], monkeypatch: pytest.MonkeyPatch
) -> tuple[Router, GroupPool]:
    """The real router over groups named by ``scripts`` (each answers as its script says)."""

    def fake_stream(client: object, ids: list[int], s: SamplingParams, rid: str, *_: object) -> Any:
        return scripts[str(client)](str(client), ids, s)

    monkeypatch.setattr(generation.upstream, "stream", fake_stream)
    cfg = RouterConfig(
        spec=RouterSpec(port=1), model_name="smollm2", engine_dir=engine_dir,
        groups=[GroupEndpoint(name=n, grpc_url=f"127.0.0.1:{i + 1}") for i, n in enumerate(scripts)],
    )  # fmt: skip
    pool = ScriptedPool.of(cfg.groups)
    return Router(cfg, pool), pool

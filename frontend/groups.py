"""The decode groups behind the router: who is up, who has the least work, who to try next.

Load is the router's own count of each group's outstanding tokens (the prompt tokens it must
compute until the first token arrives, plus the tokens still allowed to be generated): every
request of the deployment comes through here, so this count is exact and current, with no
polling. A request goes to the group with the least expected work: that load plus the prompt
tokens the group's prefix cache lacks (``cache_index.py``, kept from each group's KV events,
polled with every readiness probe) — which, with decode-first reuse, are also the KV it would
have moved from a prefill group. A group leaves rotation when a call to it fails in transport or
a readiness probe fails, and comes back when a probe succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import InferenceServerException

from frontend import upstream
from frontend.cache_index import CacheIndex
from frontend.config import GroupEndpoint
from serving.names import Model

log = logging.getLogger("frontend.groups")


@dataclass(slots=True)
class Group:
    name: str
    url: str
    client: aioclient.InferenceServerClient | None = None  # made in the server's event loop (``open``)
    up: bool = False
    why_down: str = "not probed yet"
    outstanding: int = 0  # tokens
    in_flight: int = 0
    served: int = 0
    cache: CacheIndex = field(default_factory=CacheIndex)


@dataclass(slots=True)
class Ticket:
    """One request's share of a group's load: its prompt until the first token, then the tokens it may still get."""

    group: Group
    prompt_tokens: int
    max_tokens: int
    cost: int = 0

    def __post_init__(self) -> None:
        self.cost = self.prompt_tokens + self.max_tokens

    def progress(self, generated: int) -> None:
        now = max(self.max_tokens - generated, 0)
        self.group.outstanding += now - self.cost
        self.cost = now


@dataclass(slots=True)
class GroupPool:
    groups: list[Group] = field(default_factory=list)

    @classmethod
    def of(cls, endpoints: list[GroupEndpoint]) -> GroupPool:
        return cls([Group(e.name, e.grpc_url) for e in endpoints])

    def open(self) -> None:
        """gRPC clients for every group, bound to the running event loop."""
        for g in self.groups:
            g.client = aioclient.InferenceServerClient(g.url)

    @property
    def ready(self) -> bool:
        return any(g.up for g in self.groups)

    def pick(
        self, exclude: set[str], prompt: Sequence[int] = (), salt: str | None = None, prefer: str | None = None
    ) -> tuple[Group, int] | None:
        """The up group not in ``exclude`` with the least expected work (outstanding tokens plus the
        ``prompt`` tokens its cache lacks; then fewest requests), and its expected cached tokens;
        ``prefer``: that group while it is up and not excluded (it just computed this prompt)."""
        candidates = [(g, g.cache.cached_tokens(prompt, salt)) for g in self.groups if g.up and g.name not in exclude]
        preferred = [c for c in candidates if c[0].name == prefer]
        if preferred:
            return preferred[0]
        best = min(candidates, key=lambda c: (c[0].outstanding + len(prompt) - c[1], c[0].in_flight), default=None)
        return best

    @contextlib.contextmanager
    def track(self, group: Group, prompt_tokens: int, max_tokens: int) -> Iterator[Ticket]:
        ticket = Ticket(group, prompt_tokens, max_tokens)
        group.outstanding += ticket.cost
        group.in_flight += 1
        try:
            yield ticket
        finally:
            group.outstanding -= ticket.cost
            group.in_flight -= 1
            group.served += 1

    def down(self, group: Group, why: str) -> None:
        if group.up:
            log.warning("decode group %s (%s) leaves rotation: %s", group.name, group.url, why)
        group.up, group.why_down = False, why

    async def probe(self, timeout_s: float) -> None:
        await asyncio.gather(*(self._probe(g, timeout_s) for g in self.groups))

    async def _probe(self, group: Group, timeout_s: float) -> None:
        assert group.client is not None, "GroupPool.open() first"
        try:
            ready = await asyncio.wait_for(group.client.is_model_ready(Model.DECODE.value), timeout_s)
        except (InferenceServerException, grpc.aio.AioRpcError, TimeoutError, OSError) as exc:
            self.down(group, f"readiness probe failed: {type(exc).__name__}: {exc}")
            return
        if not ready:
            self.down(group, f"model {Model.DECODE.value} is not ready")
        else:
            if not group.up:
                log.info("decode group %s (%s) is in rotation", group.name, group.url)
                group.up, group.why_down = True, ""
            await self._poll_events(group, timeout_s)

    async def _poll_events(self, group: Group, timeout_s: float) -> None:
        """The group's prefix-cache events since the last poll (a failure only delays them)."""
        assert group.client is not None
        try:
            batch = await asyncio.wait_for(upstream.events(group.client, group.cache.query(), timeout_s), timeout_s)
        except (upstream.GroupUnavailable, upstream.Refused, TimeoutError) as exc:
            log.debug("decode group %s: no cache events this time: %s", group.name, exc)
            return
        group.cache.apply(batch)

    async def probe_forever(self, interval_s: float) -> None:
        while True:
            await self.probe(timeout_s=max(interval_s, 1.0))
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for g in self.groups:
            if g.client is not None:
                await g.client.close()
                g.client = None

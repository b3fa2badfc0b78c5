"""The decode groups behind the router: who is up, who has the least work, who to try next.

Load is the router's own count of each group's outstanding tokens (the prompt tokens it must
compute until the first token arrives, plus the tokens still allowed to be generated): every
request of the deployment comes through here, so this count is exact and current, with no
polling. A request goes to the group with the least expected work: that load plus the prompt
tokens the group's prefix cache lacks (``cache_index.py``, kept from each group's KV events,
polled with every readiness probe) — which, with decode-first reuse, are also the KV it would
have moved from a prefill group. A group leaves rotation when a call to it fails in transport or
a readiness probe fails, and comes back when a probe succeeds.

A probe is also a liveness check of the model, not only of the server: its events call is
answered by the node's ``decode`` model with how long its serving loop has been in one pass
(``stalled_s``) and how long its longest recent step took (``longest_step_s``). A group that does
not answer within ``probe_timeout_s`` leaves rotation; one whose loop has been in a pass both
``stall_timeout_s`` and ``STALL_STEPS`` times its longest recent step or longer — so a deployment
whose steps take seconds (a big model on CPU) is not taken for hung in one of them — or that has
been silent ``stall_timeout_s``, is *hung*: ``Group.hung`` is set, and the requests streaming from
it give up on it (before their first token they are retried on another group) instead of waiting
out the request deadline.
The node's own watchdog ends a wedged process later (``loop_stall_s``) and the launcher restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import InferenceServerException

from frontend import upstream
from frontend.cache_index import CacheIndex
from frontend.config import GroupEndpoint, RouterSpec
from serving.grpc_channel import aio_client
from serving.names import Model
from serving.node_config import GRPC_AUTH_HEADER

log = logging.getLogger("frontend.groups")

STALL_STEPS = 4  # a pass this many times the group's longest recent step (and stall_timeout_s) is a hang


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
    headers: dict[str, str] | None = None  # the deployment's key (decode nodes restrict inference)
    hung: asyncio.Event = field(default_factory=asyncio.Event)  # set: its streams give up on it
    answered_at: float = field(default_factory=time.monotonic)  # the last probe it answered


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
    probe_timeout_s: float = RouterSpec.model_fields["probe_timeout_s"].default
    stall_timeout_s: float = RouterSpec.model_fields["stall_timeout_s"].default

    @classmethod
    def of(cls, endpoints: list[GroupEndpoint], spec: RouterSpec | None = None, key: str | None = None) -> GroupPool:
        """``key``: the deployment's secret, sent with every call to a group."""
        spec = spec or RouterSpec()
        headers = {GRPC_AUTH_HEADER: key} if key else None
        groups = [Group(e.name, e.grpc_url, headers=headers) for e in endpoints]
        return cls(groups, spec.probe_timeout_s, spec.stall_timeout_s)

    def open(self) -> None:
        """gRPC clients for every group, bound to the running event loop."""
        for g in self.groups:
            g.client = aio_client(g.url)

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

    def _hung(self, group: Group, why: str) -> None:
        self.down(group, why)
        if not group.hung.is_set():
            log.error("decode group %s (%s) is hung: %s; its streams give up on it", group.name, group.url, why)
            group.hung.set()

    def _alive(self, group: Group, stalled_s: float, longest_step_s: float = 0.0) -> None:
        """The group answered a probe: hung while its loop has been in one pass too long (longer than
        ``stall_timeout_s`` and than ``STALL_STEPS`` of its longest recent steps)."""
        group.answered_at = time.monotonic()
        if stalled_s >= max(self.stall_timeout_s, STALL_STEPS * longest_step_s):
            self._hung(
                group, f"its loop has been in one pass for {stalled_s:.0f} s (longest step {longest_step_s:.1f} s)"
            )
            return
        if group.hung.is_set():
            group.hung = asyncio.Event()  # a fresh one for the streams that start from now on
        if not group.up:
            log.info("decode group %s (%s) is in rotation", group.name, group.url)
            group.up, group.why_down = True, ""

    async def probe(self, timeout_s: float) -> None:
        await asyncio.gather(*(self._probe(g, timeout_s) for g in self.groups))

    async def _probe(self, group: Group, timeout_s: float) -> None:
        """Ready, then the events call: the group's cache events and how long its loop is in a pass."""
        assert group.client is not None, "GroupPool.open() first"
        try:
            ready = await asyncio.wait_for(
                group.client.is_model_ready(Model.DECODE.value, headers=group.headers), timeout_s
            )
            if not ready:
                self.down(group, f"model {Model.DECODE.value} is not ready")
                return
            call = upstream.events(group.client, group.cache.query(), timeout_s + 1.0, group.headers)  # ours first
            batch = await asyncio.wait_for(call, timeout_s)
        except upstream.Refused as exc:  # answered: alive, but no events this time
            log.debug("decode group %s: no cache events this time: %s", group.name, exc)
            self._alive(group, 0.0)
            return
        except (InferenceServerException, grpc.aio.AioRpcError, upstream.GroupUnavailable, TimeoutError, OSError) as e:
            timed_out = isinstance(e, TimeoutError)  # reached but silent (refused / reset: down, not hung)
            why = f"no answer to a probe in {timeout_s:g} s" if timed_out else f"probe failed: {type(e).__name__}: {e}"
            silent = time.monotonic() - group.answered_at
            if timed_out and silent >= self.stall_timeout_s:
                self._hung(group, f"{why}; silent for {silent:.0f} s")
            else:
                self.down(group, why)
            return
        group.cache.apply(batch)
        self._alive(group, batch.stalled_s, batch.longest_step_s)

    async def probe_forever(self, interval_s: float) -> None:
        while True:
            await self.probe(timeout_s=self.probe_timeout_s)
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for g in self.groups:
            if g.client is not None:
                await g.client.close()
                g.client = None

"""A node's prefix-cache events for routers: vLLM's KV-event shape, over the node's ``decode`` model.

The engine's cache logs stored / removed / cleared blocks with sequence numbers
(``torch_engine.prefix_cache``); the serving loop hands them over with every report (its own
thread), and ``KVEventLog`` keeps them for readers on other threads together with the set of
blocks cached now. A reader asks ``since(instance, seq)``: it gets the events after ``seq``, or a
snapshot (every cached block) when it is new, behind the bounded log, or talking to another
instance (the node restarted: its cache is new). So a router that missed events or outlived a
node resynchronises by itself; it never needs to see every event.

On the wire (``decode`` model, a control call like ``stop``): input ``kv_events_query`` (a
``KVEventsQuery`` as JSON), output ``kv_events`` (a ``KVEventBatch`` as JSON). Block hashes are
``prefix_cache.block_hash`` of the engine's chained page keys; a router computes the same for a
prompt from ``identity`` and ``block_size`` (``prefix_cache.root_key`` / ``chain_keys``).

The answer is also the router's liveness probe of the node's loop: ``stalled_s`` is how long
the loop's current pass has run (an idle loop passes every few milliseconds). It is answered on
Triton's request thread, so a node whose loop is wedged still answers, and says so; a node
whose stub is wedged does not answer, which the router reads the same way.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from torch_engine.prefix_cache import EVENT_LOG, CacheEvents, KVEvent, KVEventKind

EVENTS_VERSION = 3  # 2: stalled_s; 3: longest_step_s


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlockStored(_Msg):
    type: Literal["BlockStored"] = "BlockStored"
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "CPU"


class BlockRemoved(_Msg):
    type: Literal["BlockRemoved"] = "BlockRemoved"
    block_hashes: list[int]
    medium: str = "CPU"


class AllBlocksCleared(_Msg):
    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


Event = Annotated[BlockStored | BlockRemoved | AllBlocksCleared, Field(discriminator="type")]


class KVEventsQuery(_Msg):
    version: int = EVENTS_VERSION
    instance: str = ""  # the instance the reader last heard from ("" : none yet)
    seq: int = Field(default=0, ge=0)  # the last sequence number it applied


class KVEventBatch(_Msg):
    """vLLM's ``KVEventBatch`` (``ts``, ``events``) plus what a reader needs to follow it."""

    version: int = EVENTS_VERSION
    ts: float
    instance: str  # this node's log; a new one after a restart
    identity: str  # the engine's cache identity (the root of every key chain)
    block_size: int
    seq: int  # the last event's sequence number (the reader's next ``since``)
    events: list[Event] = Field(default_factory=list)
    snapshot: list[int] | None = None  # set: every block cached now (apply it instead of the events)
    stalled_s: float = Field(default=0.0, ge=0)  # how long the node's serving loop has been in one pass
    longest_step_s: float = Field(default=0.0, ge=0)  # the longest of its recent passes that stepped the engine


def _wire(e: KVEvent) -> Event:
    if e.kind is KVEventKind.STORED:
        return BlockStored(
            block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash, token_ids=list(e.token_ids),
            block_size=e.block_size,
        )  # fmt: skip
    if e.kind is KVEventKind.REMOVED:
        return BlockRemoved(block_hashes=list(e.block_hashes))
    return AllBlocksCleared()


class KVEventLog:
    """The node's events for readers on any thread (``record`` from the serving loop's thread)."""

    def __init__(self, identity: str, block_size: int, capacity: int = EVENT_LOG) -> None:
        self.instance = uuid.uuid4().hex
        self.identity = identity
        self.block_size = block_size
        self._lock = threading.Lock()
        self._events: deque[tuple[int, Event]] = deque(maxlen=capacity)
        self._seq = 0  # this log's own numbering (the engine's restarts with a new engine)
        self._floor = 0  # readers at or below it must take a snapshot
        self._blocks: set[int] = set()
        self.engine_seq = 0  # the engine's last sequence number handed over (the loop's next ``since``)

    def record(self, got: CacheEvents) -> None:
        with self._lock:
            self.engine_seq = got.seq
            if got.snapshot is not None:  # the loop fell behind the engine's log: start over
                self._blocks = set(got.snapshot)
                self._events.clear()
                self._seq += 1
                self._floor = self._seq
                return
            for e in got.events:
                if e.kind is KVEventKind.STORED:
                    self._blocks.update(e.block_hashes)
                elif e.kind is KVEventKind.REMOVED:
                    self._blocks.difference_update(e.block_hashes)
                else:
                    self._blocks.clear()
                self._seq += 1
                self._events.append((self._seq, _wire(e)))

    def since(self, query: KVEventsQuery, stalled_s: float = 0.0, longest_step_s: float = 0.0) -> KVEventBatch:
        """The events after ``query.seq`` (a snapshot instead when the reader is behind or new), with
        the loop's pulse: how long its pass in progress and its longest recent step have run."""
        pulse = (stalled_s, longest_step_s)
        with self._lock:
            seq = self._seq
            fresh = query.instance == self.instance and self._floor <= query.seq <= seq
            kept = not self._events or self._events[0][0] <= query.seq + 1
            if fresh and kept:
                events = [e for s, e in self._events if s > query.seq]
                return self._batch(seq, events, None, pulse)
            return self._batch(seq, [], sorted(self._blocks), pulse)

    def _batch(
        self, seq: int, events: list[Event], snapshot: list[int] | None, pulse: tuple[float, float]
    ) -> KVEventBatch:
        return KVEventBatch(
            ts=time.time(), instance=self.instance, identity=self.identity, block_size=self.block_size, seq=seq,
            events=events, snapshot=snapshot, stalled_s=pulse[0], longest_step_s=pulse[1],
        )  # fmt: skip

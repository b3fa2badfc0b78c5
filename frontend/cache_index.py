"""What the router knows of each decode group's prefix cache, from the group's KV events.

Per group it keeps the node's event-log instance, the last sequence number applied and the set
of block hashes cached there (at most the node's page count). It polls with that instance and
number (``GroupPool.probe``) and applies what comes back: events in order, or a snapshot that
replaces the set — which is what a node answers a reader that is new, fell behind its bounded
log, or names an instance that is gone (the node restarted, its cache empty). A missed poll
only delays what the router knows; nothing is ever applied twice or out of order.

``cached_tokens`` is the router's estimate of a prompt's hit on a group: the longest run of the
prompt's full pages (the engine's own chained keys, ``torch_engine.prefix_cache``) found in the
set, never the whole prompt (the engine always computes the last token). It steers routing only;
the tokens a request reuses are the engine's count (``usage.prompt_tokens_details``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.kv_events import BlockRemoved, BlockStored, KVEventBatch, KVEventsQuery
from torch_engine.prefix_cache import block_hash, chain_keys, root_key


@dataclass(slots=True)
class CacheIndex:
    instance: str = ""
    seq: int = 0
    identity: str = ""
    block_size: int = 0
    blocks: set[int] = field(default_factory=set)
    resyncs: int = 0  # snapshots applied (the first one included)

    def query(self) -> KVEventsQuery:
        return KVEventsQuery(instance=self.instance, seq=self.seq)

    def apply(self, batch: KVEventBatch) -> None:
        self.instance, self.seq = batch.instance, batch.seq
        self.identity, self.block_size = batch.identity, batch.block_size
        if batch.snapshot is not None:
            self.blocks = set(batch.snapshot)
            self.resyncs += 1
            return
        for e in batch.events:
            if isinstance(e, BlockStored):
                self.blocks.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.blocks.difference_update(e.block_hashes)
            else:
                self.blocks.clear()

    def cached_tokens(self, prompt: Sequence[int], salt: str | None) -> int:
        p = self.block_size
        if not p or not self.blocks:
            return 0
        limit = (len(prompt) - 1) // p
        found = 0
        for key in chain_keys(root_key(self.identity, salt), prompt, p, 0, limit):
            if block_hash(key) not in self.blocks:
                break
            found += 1
        return found * p

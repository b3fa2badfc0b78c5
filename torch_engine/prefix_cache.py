"""Automatic prefix caching: full KV pages addressed by their content, shared across requests.

A page's key chains its parent's key and its ``page_size`` token ids; the chain's root is the
engine's identity (model fingerprint, KV dtype and layout) and the request's optional
``cache_salt``, so requests with different salts never share a page. Once every token of a page
has final KV (``num_computed`` past it; rejected draft positions never count), ``register`` files
the page under its key and marks it cached in the allocator (``pages.py``): from then on nobody
writes it, and when its last holder lets go it stays, unheld, in the allocator's LRU until the
pool needs it (eviction calls back here and drops the key).

A new request ``match``-es the longest chain of cached pages its tokens start with, and computes
only the rest: at most ``(compute_target - 1) // page_size`` pages are taken, so at least the last
token runs (a step samples it, or a prefill-only request's layer counter moves) and no step ever
writes a shared page. Two requests that compute the same page at once keep one copy cached; the
other stays private and goes back to the free list.

A prompt rarely ends on a page boundary: its last partial page is never cached. While another request
that holds the same tokens there runs (``n`` > 1's other choices, started after the first one's first
token; the same prompt sent twice at once), ``tail`` finds that request's page, and the scheduler
copies it into a fresh page of the new request's own (copy on write: the holder goes on writing its
page past the shared tokens; ``SchedulerOutput.copies``, done by every rank before the step's forward
pass), so the new request computes only its last token (not for requests that read MTP-layer KV).

On a model with an MTP module, a page's MTP-layer KV exists only where the draft pass ran for
every position of it (requests that draft, and prefill-only ones); ``needs_mtp`` says which
requests read it, and their matches stop at the first cached page without it.

Events (``KVEvent``, vLLM's KV-event shape: stored / removed / all cleared) get sequence numbers;
``events_since(seq)`` gives a consumer what it has not seen, or None when some were dropped from
the bounded log, in which case it must start over from ``snapshot()``.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch_engine.config import KVLayout
from torch_engine.pages import PageAllocator
from torch_engine.request import Request

EVENT_LOG = 4096  # events kept for consumers that poll


class KVEventKind(enum.IntEnum):
    STORED = 0  # vLLM BlockStored
    REMOVED = 1  # vLLM BlockRemoved
    ALL_CLEARED = 2  # vLLM AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int | None = None  # STORED: the first block's parent (None: a chain's root)
    token_ids: tuple[int, ...] = ()  # STORED: the blocks' tokens, in order
    block_size: int = 0


def cache_identity(fingerprint: str, dtype: object, kv_dtype: object, layout: KVLayout) -> str:
    """What a page's bytes depend on besides its tokens: the model, the compute dtype, the pages' own dtype where
    it differs (bf16 pages under an fp32 engine hold other values than fp32 ones), the layout."""
    kv = f"/kv-{kv_dtype}" if kv_dtype != dtype else ""
    return f"{fingerprint}/{dtype}{kv}/{layout.value}"


def root_key(identity: str, salt: str | None) -> bytes:
    """The key every chain of an engine (``identity``) and a salt starts from."""
    h = hashlib.blake2b(identity.encode(), digest_size=16)
    if salt is not None:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def chain_keys(parent: bytes, tokens: Sequence[int], page_size: int, first: int, n: int) -> list[bytes]:
    """Keys of pages ``first .. n-1`` of ``tokens`` (full pages), ``parent`` being page ``first - 1``'s
    key (or the root). A router computes the same keys for a prompt (``block_hash``: the published form)."""
    keys = []
    for j in range(first, n):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("I", tokens[j * page_size : (j + 1) * page_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """``req.all_tokens[start:end]`` without copying the whole prompt."""
    n = len(req.prompt_ids)
    if end <= n:
        return req.prompt_ids[start:end]
    return req.prompt_ids[start:] + req.output_ids[max(start - n, 0) : end - n]


def block_hash(key: bytes) -> int:
    """A key as published in events (vLLM's block hashes are integers)."""
    return int.from_bytes(key[:8], "little")


@dataclass(frozen=True, slots=True)
class CacheStats:
    cached_pages: int  # pages filed under a key (held or not)
    queries: int  # tokens requests looked up at their first admission
    hits: int  # of them, found cached


NO_CACHE = CacheStats(0, 0, 0)


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """What a consumer at sequence number ``since`` has not seen: the ``events`` after it, or, when
    some were dropped from the bounded log, ``snapshot`` (every cached block's hash now) instead."""

    seq: int  # the last event's sequence number
    events: tuple[KVEvent, ...] = ()
    snapshot: tuple[int, ...] | None = None


class PrefixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        identity: str,
        needs_mtp: Callable[[Request], bool] | None = None,
        log_size: int = EVENT_LOG,
    ) -> None:
        self._alloc = allocator
        self._page_size = page_size
        self._identity = identity
        self._needs_mtp = needs_mtp  # None: the model has no MTP layer
        self._with_mtp: set[int] = set()  # cached pages that hold MTP-layer KV too
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._parent_of: dict[bytes, bytes | None] = {}
        self._roots: dict[str | None, bytes] = {}
        self._events: deque[KVEvent] = deque(maxlen=log_size)
        self._seq = 0
        self.queries = 0  # prompt tokens looked up (hit rate: hits / queries)
        self.hits = 0  # of them, found cached
        allocator.on_evict = self._evicted

    # -- lookups -------------------------------------------------------------------------
    def match(self, req: Request) -> list[int]:
        """Pages of the longest cached page-aligned prefix of ``req``'s tokens (leaving at least
        one token to compute); takes nothing (``PageAllocator.share`` does)."""
        if req.params.prompt_logprobs is not None:
            return []  # it scores every prompt position: cached KV carries no logits
        limit = max(req.compute_target - 1, 0) // self._page_size
        mtp = self._needs_mtp is not None and self._needs_mtp(req)
        pages: list[int] = []
        for key in self._keys(req, limit):
            page = self._by_key.get(key)
            if page is None or (mtp and page not in self._with_mtp):
                break
            pages.append(page)
        return pages

    def tail(self, req: Request, hit: list[int], holders: Iterable[Request]) -> tuple[int, int] | None:
        """``(page, tokens)``: a page of a request in ``holders`` whose first ``tokens`` slots hold the KV of
        ``req``'s tokens past its ``hit`` (``match`` found every page it may take, and its prompt ends
        inside the next page), to be copied into a page of ``req``'s own; None when there is nothing to
        copy or no holder has those tokens with final KV."""
        p = self._page_size
        limit = max(req.compute_target - 1, 0)
        f = len(hit)
        t = limit - f * p
        if t <= 0 or f != limit // p or req.params.prompt_logprobs is not None:
            return None
        if self._needs_mtp is not None and self._needs_mtp(req):
            return None  # a holder's MTP-layer KV of its last positions may still be missing: compute them
        parent = self._keys(req, f)[-1] if f else None
        want = _tokens(req, f * p, f * p + t)
        salt = req.params.cache_salt
        for other in holders:
            if other is req or len(other.pages) <= f or other.num_computed < f * p + t:
                continue  # its KV of those positions is not final (or not there)
            if other.params.cache_salt != salt or _tokens(other, f * p, f * p + t) != want:
                continue
            if parent is None or self._keys(other, f)[-1] == parent:
                return other.pages[f], t
        return None

    def count(self, req: Request, tokens: int) -> None:
        """Hit-rate accounting of one admission: the first ``tokens`` of its prefix were found cached."""
        self.queries += req.compute_target
        self.hits += tokens

    def stats(self) -> CacheStats:
        return CacheStats(len(self._by_key), self.queries, self.hits)

    # -- filing pages --------------------------------------------------------------------
    def register(self, req: Request) -> None:
        """File every page of ``req`` whose tokens all have final KV now."""
        full = min(req.num_computed // self._page_size, len(req.pages))
        if full <= req.cache_registered:
            return
        keys = self._keys(req, full)
        stored: list[int] = []
        first = req.cache_registered
        for j in range(first, full):
            page, key = req.pages[j], keys[j]
            if self._alloc.is_cached(page) or key in self._by_key:
                continue  # a hit page, or a copy computed at the same time as the cached one
            self._by_key[key], self._key_of[page] = page, key
            self._parent_of[key] = keys[j - 1] if j else None
            self._alloc.mark_cached(page)
            if self._needs_mtp is not None and not req.mtp_kv_gap:
                self._with_mtp.add(page)
            stored.append(j)
        req.cache_registered = full
        if stored:
            self._stored(req, keys, stored)

    def clear(self) -> int:
        """Evict every cached page nobody holds (held ones stay cached); returns how many."""
        n = self._alloc.evict_all()
        if not self._by_key:
            self._log(KVEventKind.ALL_CLEARED)
        return n

    # -- events --------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """The last event's sequence number (0: none yet)."""
        return self._seq

    def events_since(self, seq: int) -> CacheEvents:
        """Events after ``seq``, or a snapshot when some of them are no longer kept."""
        if seq >= self._seq:
            return CacheEvents(self._seq)
        if not self._events or self._events[0].seq > seq + 1:
            return CacheEvents(self._seq, snapshot=tuple(block_hash(k) for k in self._by_key))
        return CacheEvents(self._seq, tuple(e for e in self._events if e.seq > seq))

    # -- internals -----------------------------------------------------------------------
    @property
    def identity(self) -> str:
        return self._identity

    def _root(self, salt: str | None) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_key(self._identity, salt)
        return root

    def _keys(self, req: Request, n: int) -> list[bytes]:
        """The keys of ``req``'s first ``n`` pages (kept on the request; its tokens only grow)."""
        keys = req.cache_keys
        if len(keys) < n:
            parent = keys[-1] if keys else self._root(req.params.cache_salt)
            keys += chain_keys(parent, req.all_tokens, self._page_size, len(keys), n)
        return keys[:n]

    def _evicted(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._by_key[key]
        self._with_mtp.discard(page)
        self._parent_of.pop(key, None)
        self._log(KVEventKind.REMOVED, (block_hash(key),))

    def _stored(self, req: Request, keys: list[bytes], stored: list[int]) -> None:
        p, tokens = self._page_size, req.all_tokens
        runs: list[list[int]] = []  # consecutive pages: one event each
        for j in stored:
            if runs and runs[-1][-1] == j - 1:
                runs[-1].append(j)
            else:
                runs.append([j])
        for run in runs:
            parent = self._parent_of[keys[run[0]]]
            self._log(
                KVEventKind.STORED,
                tuple(block_hash(keys[j]) for j in run),
                block_hash(parent) if parent is not None else None,
                tuple(tokens[run[0] * p : (run[-1] + 1) * p]),
            )

    def _log(
        self, kind: KVEventKind, hashes: tuple[int, ...] = (), parent: int | None = None, tokens: tuple[int, ...] = ()
    ) -> None:
        self._seq += 1
        self._events.append(KVEvent(self._seq, kind, hashes, parent, tokens, self._page_size if tokens else 0))

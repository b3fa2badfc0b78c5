"""Prefill side of the KV messenger: one per prefill TP rank.

Per request (``PrefillJobState``, ordered):

    STREAMING ──last chunk scheduled──> DRAINING ──every posted write done, FIN sent──> DONE
        └──────────abort (local, or an ABORTED notification from the decoder)──────> ABORTED
        └──────────the request's deadline (arrival + ``ttl_s``) passed────────────────> ABORTED
    any ──a write FAILED──> FAILED

Fencing (the decoder reuses a page only when every sender confirmed it will write no more):
every job ends with FIN or ABORTED (``count`` = writes posted) to each decode rank; an ABORTED
for an epoch this rank does not hold (the prefill request has not arrived, or never will) is
answered with ABORTED (count 0) at once and remembered as a tombstone for ``tombstone_s``, so
that request is refused if it arrives late; a job past its deadline posts nothing more (writes
still in flight are cancelled) and closes. A request refused before any rank started it is
answered with REFUSED (``refuse``): the decoder fails it with the reason at once.

Queues: ``jobs`` (request id -> job); per job, ``pending`` batches ``(forward pass, pages)`` in
step order, and ``inflight`` transfer handles. The engine thread calls ``schedule`` *before* a
step runs with the pages that the step completes; the messenger thread polls the engine's
per-layer counter and posts the writes of every layer finished since its last pass at once
(one transfer per decode rank, carrying a KV notification with its write count; adjacent pages
coalesced into one range). With ``stream_layers=False`` (the benchmark's baseline) nothing goes
out until the engine reports the prefill done (``prefill_done``). Pages are sent whole and
once: a page shared by two chunks is sent after the chunk that fills it (or the last chunk).
Pages the decoder's prefix cache already holds are never sent: page ``i`` of a job is the prompt's
page ``first_page + i`` here (``PrefillRequest.first_page``); pages this node's own prefix cache
supplied go out with the first forward pass that runs. After the last chunk the leader writes the
metadata (the last position's hidden state, fp32) into the decoder's slot. When every write
completed, FIN goes to each decode rank this rank wrote to, and the request appears in
``completed()`` so the caller can free its source pages.

Long because: one state machine (the transitions above) and the messenger thread that drives it
read best in one place; which bytes go where is ``shard_plan``'s, how they move the transport's.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kv_messenger.layout import KVLayoutSpec, check_compatible
from kv_messenger.protocol import Notification, NotifKind, PrefillRequest, RankEndpoint
from kv_messenger.shard_plan import PageWrite, plan_writes
from kv_messenger.transport.base import TransferState, Transport

log = logging.getLogger(__name__)


class ProgressSource(Protocol):
    def completed(self, layer: int) -> int: ...


def _coalesce(ranges: np.ndarray) -> np.ndarray:
    """Merge writes (rows of ``[src, dst, length]``) that continue each other on both sides."""
    if len(ranges) < 2:
        return ranges
    src, dst, n = ranges[:, 0], ranges[:, 1], ranges[:, 2]
    joins = (src[:-1] + n[:-1] == src[1:]) & (dst[:-1] + n[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(n, starts)
    return np.stack([src[starts], dst[starts], lengths], axis=1)


class PrefillJobState(enum.IntEnum):
    STREAMING = 0
    DRAINING = 1
    DONE = 2
    ABORTED = 3
    FAILED = 4


@dataclass(slots=True)
class _Batch:
    forward: int  # the forward pass (counter value) whose layers must finish
    pages: list[int]  # page indices (token order) that this forward completes
    next_layer: int = 0


@dataclass(slots=True)
class _Job:
    req: PrefillRequest
    src_pages: list[int]  # this rank's pages of the request, token order (grows with the chunks)
    slices: dict[int, list[PageWrite]]  # decode rank -> this rank's slices of every page (same for all pages)
    n_pages: int
    state: PrefillJobState = PrefillJobState.STREAMING
    pending: deque[_Batch] = field(default_factory=deque)
    queued_pages: int = 0  # pages [0, queued_pages) are in some batch
    inflight: list[tuple[object, int, int]] = field(default_factory=list)  # (handle, decode rank, writes)
    posted: dict[int, int] = field(default_factory=dict)  # decode rank -> writes posted
    meta: torch.Tensor | None = None
    meta_posted: bool = False
    staging_slot: int | None = None
    bytes_posted: int = 0
    prefill_done: bool = False  # the engine finished the request's prefill (set by ``prefill_done``)
    error: str | None = None
    deadline: float = float("inf")  # past it, nothing more is posted and the job closes ABORTED


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    request_id: str
    state: PrefillJobState
    error: str | None
    bytes_posted: int = 0


class PrefillSide:
    def __init__(
        self,
        transport: Transport,
        layout: KVLayoutSpec,
        pools: Sequence[torch.Tensor],
        progress: ProgressSource,
        meta_slot_bytes: int = 0,
        meta_slots: int = 8,
        poll_interval_s: float = 0.0005,
        stream_layers: bool = True,
        layers_per_post: int = 1,
        tombstone_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(pools) != layout.num_layers:
            raise ValueError(f"{len(pools)} pools for {layout.num_layers} layers")
        self.transport = transport
        self.layout = layout
        self.pools = list(pools)
        self.progress = progress
        self.poll_interval_s = poll_interval_s
        self.stream_layers = stream_layers  # False: send nothing until ``prefill_done`` (a baseline)
        # post once this many layers are finished (or the forward is over): fewer, larger writes where
        # the copies compete with the forward pass for the same core (shared-memory UCX on a CPU)
        self.layers_per_post = max(1, layers_per_post)
        transport.register(self.pools)
        self._staging = torch.zeros(max(meta_slots, 1), max(meta_slot_bytes, 1), dtype=torch.uint8)
        transport.register([self._staging])
        self._free_staging = deque(range(self._staging.shape[0]))
        self._peers: dict[str, RankEndpoint] = {}
        self._peer_pools: dict[str, tuple[list[int], int]] = {}  # agent -> (layer base addresses, page bytes)
        self._page_bytes = layout.page_bytes
        self._jobs: dict[str, _Job] = {}
        self.tombstone_s = tombstone_s
        self.clock = clock
        self._tombstones: dict[tuple[str, int], float] = {}  # (request, epoch) aborted before it arrived -> expiry
        self.expired = 0  # jobs closed by their deadline
        self.failure: str | None = None  # set when the messenger thread died (the node must not go on)
        self._done: deque[PrefillOutcome] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._moved = False  # the last poll_once made progress (not merely writes in flight)
        self.idle_wait_s = 0.005
        self._thread: threading.Thread | None = None

    # -- set-up --------------------------------------------------------------------------
    def endpoint(self) -> RankEndpoint:
        return RankEndpoint.of(self.transport.name, self.transport.metadata(), self.layout, self.pools)

    def connect(self, decode_ranks: Sequence[RankEndpoint]) -> None:
        """Handshake with a decode group: layouts must match (else nothing is ever sent). Safe while
        the messenger thread runs (a group that came up later)."""
        for ep in decode_ranks:
            check_compatible(self.layout, ep.layout)
        with self._lock:
            for ep in decode_ranks:
                self.transport.add_peer(ep.agent, ep.metadata)
                self._peers[ep.agent] = ep
                self._peer_pools[ep.agent] = (list(ep.layer_addrs), ep.layout.page_bytes)

    def connected(self, agents: Sequence[str]) -> bool:
        """Every one of ``agents`` is a decode rank this rank shook hands with."""
        with self._lock:
            return all(a in self._peers for a in agents)

    def peer_endpoint(self, agent: str) -> RankEndpoint:
        return self._peers[agent]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kv-prefill-{self.transport.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    # -- engine thread -------------------------------------------------------------------
    def submit(self, req: PrefillRequest) -> None:
        """A prefill request this rank takes part in (its source pages come with each ``schedule``)."""
        n_pages = len(req.dst_pages)
        dst_layout = self._dst_layout(req)
        # every page moves the same slices, so the plan of one page is the template of all
        template: dict[int, list[PageWrite]] = {}
        for w in plan_writes(self.layout, dst_layout, [(0, 0)], req.seed).for_source(self.layout.tp_rank):
            template.setdefault(w.dst_rank, []).append(w)
        job = _Job(req, [], template, n_pages, deadline=self.clock() + req.ttl_s)
        with self._lock:
            if (req.request_id, req.epoch) in self._tombstones:
                raise ValueError(f"request {req.request_id} epoch {req.epoch}: the decoder aborted it before it came")
            old = self._jobs.get(req.request_id)
            if old is not None and old.req.epoch >= req.epoch:
                raise ValueError(f"request {req.request_id} epoch {req.epoch} is not newer than {old.req.epoch}")
            if old is not None and old.state < PrefillJobState.DONE:  # the engine refuses a live id first
                raise ValueError(f"request {req.request_id} epoch {old.req.epoch} is still in flight here")
            self._jobs[req.request_id] = job
        self._wake.set()

    def schedule(self, request_id: str, forward: int, tokens_done: int, last: bool, src_pages: Sequence[int]) -> None:
        """Before forward pass ``forward`` runs: after it, ``tokens_done`` tokens of KV exist in
        ``src_pages`` (the request's pages here, in token order; they must stay put until done)."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None or job.state is not PrefillJobState.STREAMING:
                return  # over already (aborted by the decoder, or never accepted on this rank)
            p, n, first = self.layout.page_size, job.n_pages, job.req.first_page
            needed = min(-(-tokens_done // p), first + n)
            if len(src_pages) < needed:
                raise ValueError(
                    f"request {request_id}: {tokens_done} tokens need {needed} source pages, got {len(src_pages)}"
                )
            job.src_pages = list(src_pages[first : first + n])  # the decoder holds the first ``first`` pages
            full = max(min(tokens_done // p, first + n) - first, 0)
            upto = n if last else full
            if upto > job.queued_pages:
                job.pending.append(_Batch(forward, list(range(job.queued_pages, upto))))
                job.queued_pages = upto
            if last:
                job.state = PrefillJobState.DRAINING

    def set_metadata(self, request_id: str, payload: torch.Tensor) -> None:
        """Leader only, after the last chunk: bytes for the decoder's metadata slot."""
        raw = payload.contiguous().view(torch.uint8).reshape(-1)
        with self._lock:
            job = self._jobs[request_id]
            if raw.numel() > self._staging.shape[1]:
                raise ValueError(f"metadata of {raw.numel()} bytes exceeds the {self._staging.shape[1]}-byte slot")
            job.meta = raw.clone()

    def prefill_done(self, request_id: str) -> None:
        """The engine finished this request's prefill (the gate when ``stream_layers`` is off)."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is not None:
                job.prefill_done = True

    def abort(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is not None and job.state < PrefillJobState.DONE:
                job.state = PrefillJobState.ABORTED

    def refuse(self, req: PrefillRequest, reason: str) -> None:
        """The group refuses ``req`` before any rank started it: tell every decode rank, with the reason."""
        note = Notification(NotifKind.REFUSED, req.request_id, req.epoch, 0, reason).encode()
        for agent in req.decode_ranks:
            if agent in self._peers:
                self.transport.send_notif(agent, note)

    def was_aborted(self, request_id: str, epoch: int) -> bool:
        """The decoder aborted this epoch before it came (a tombstone holds it)."""
        with self._lock:
            return (request_id, epoch) in self._tombstones

    def jobs(self) -> int:
        """Requests still being sent or not yet collected (tests of bounded state)."""
        with self._lock:
            return len(self._jobs) + len(self._done)

    def tombstones(self) -> int:
        """Aborted epochs remembered (tests of bounded state)."""
        with self._lock:
            return len(self._tombstones)

    def busy(self) -> bool:
        """Some request is still being sent (or its completion not yet collected)."""
        with self._lock:
            return bool(self._jobs or self._done)

    def completed(self) -> list[PrefillOutcome]:
        """Requests whose writes are all over (done, aborted or failed): free their source pages."""
        out = []
        with self._lock:
            while self._done:
                out.append(self._done.popleft())
        return out

    # -- messenger thread ----------------------------------------------------------------
    def _dst_layout(self, req: PrefillRequest) -> KVLayoutSpec:
        """The destination's layout; refuses decode ranks this rank never shook hands with and pages
        outside their pools (a prefill request must not make this rank write anywhere else)."""
        strangers = [a for a in req.decode_ranks if a not in self._peers]
        if strangers or not req.decode_ranks:
            raise ValueError(f"request {req.request_id}: decode ranks {req.decode_ranks} are not connected")
        peers = [self._peers[a] for a in req.decode_ranks]
        if any(p.layout.tp_rank != r for r, p in enumerate(peers)):
            raise ValueError(f"request {req.request_id}: decode ranks {req.decode_ranks} are not in TP-rank order")
        pool = min(p.num_pages for p in peers)
        bad = next((p for p in req.dst_pages if not 0 <= p < pool), None)
        if bad is not None:
            raise ValueError(
                f"request {req.request_id}: destination page {bad} is outside the decode pools (0..{pool - 1})"
            )
        return peers[0].layout.model_copy(update={"tp_size": len(req.decode_ranks)})

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a bug or a transport fault that is not one write's: say so, do not hang
            log.exception("the messenger thread of %s died", self.transport.name)
            self.failure = f"the messenger thread died: {exc!r}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.poll_once() and self._moved:
                continue  # something happened: look again at once
            # nothing moved (waiting for a layer, or for posted writes to complete): yield the
            # core; on a machine where this thread shares a core with the forward pass, polling
            # any faster slows the prefill itself (measured: 50 us polls made it 1.5-2x slower)
            with self._lock:
                idle = not self._jobs
            if idle:  # nothing to send: sleep until a request arrives (control messages can wait)
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
            else:
                time.sleep(self.poll_interval_s)

    def poll_once(self) -> bool:
        """One pass: control messages, newly finished layers, transfer states. True if anything moved
        or a write is in flight (the transport makes progress when polled: no busy progress thread)."""
        moved = self._control()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            moved |= self._advance(job)
        self._moved = moved
        return moved or any(job.inflight for job in jobs)  # keep driving the transport while writes are in flight

    def _control(self) -> bool:
        msgs = self.transport.notifications()
        now = self.clock()
        for agent, raw in msgs:
            try:
                note = Notification.decode(raw)
            except ValueError as exc:  # a bad peer costs its own message, never the messenger thread
                log.warning("dropped a notification from %s: %s", agent, exc)
                continue
            if note.kind is not NotifKind.ABORTED:
                continue
            with self._lock:
                job = self._jobs.get(note.request_id)
                if job is not None and agent not in job.req.decode_ranks:
                    continue  # only the job's own decode ranks may abort it
                if job is not None and job.req.epoch == note.epoch:
                    if job.state < PrefillJobState.DONE:
                        job.state = PrefillJobState.ABORTED  # closes with ABORTED (count) once nothing is in flight
                    continue
                if job is not None and job.req.epoch > note.epoch:
                    continue  # an older epoch than the one this rank holds: it was closed already
                self._tombstones[(note.request_id, note.epoch)] = now + self.tombstone_s
            reply = Notification(NotifKind.ABORTED, note.request_id, note.epoch, 0)  # never started: nothing posted
            if agent in self._peers:
                self.transport.send_notif(agent, reply.encode())
        if self._tombstones:
            with self._lock:
                for key in [k for k, t in self._tombstones.items() if t < now]:
                    del self._tombstones[key]
        return bool(msgs)

    def _advance(self, job: _Job) -> bool:
        """Post what is ready, collect finished writes, close the job when over; True if anything moved."""
        moved = False
        with self._lock:  # the engine thread moves STREAMING -> DRAINING under it: never over an ABORTED
            expired = job.state < PrefillJobState.DONE and self.clock() > job.deadline
            if expired:
                job.state, job.error = PrefillJobState.ABORTED, f"request {job.req.request_id}: deadline passed"
        if expired:
            for handle, _, _ in job.inflight:  # cancel what is still in flight; nothing more goes out
                self.transport.release(handle)
            job.inflight = []
            self.expired += 1
            moved = True
        if job.state in (PrefillJobState.STREAMING, PrefillJobState.DRAINING) and self._may_send(job):
            while job.pending:
                batch = job.pending[0]
                first, ready, last = batch.next_layer, batch.next_layer, self.layout.num_layers
                while ready < last and self.progress.completed(ready) >= batch.forward:
                    ready += 1
                if ready - first >= self.layers_per_post or (ready == last and ready > first):
                    self._post_layers(job, batch.pages, range(first, ready))  # finished layers go out together
                    batch.next_layer = ready
                    moved = True
                if batch.next_layer < self.layout.num_layers:
                    break
                job.pending.popleft()
            if (
                job.state is PrefillJobState.DRAINING
                and not job.pending
                and job.meta is not None
                and not job.meta_posted
                and self._free_staging
            ):
                self._post_meta(job)
                moved = True
        still = []
        for handle, rank, count in job.inflight:
            st = self.transport.state(handle)
            if st is TransferState.PENDING:
                still.append((handle, rank, count))
                continue
            self.transport.release(handle)
            moved = True
            if st is TransferState.FAILED:  # none of its writes landed: FIN / ABORTED will not count them
                job.posted[rank] -= count
                with self._lock:
                    job.state, job.error = PrefillJobState.FAILED, f"a KV write to decode rank {rank} failed"
        job.inflight = still
        if not job.inflight and self._finished(job):
            self._close(job)
            moved = True
        return moved

    def _may_send(self, job: _Job) -> bool:
        """With layer streaming off, nothing goes out until the engine reported the prefill done."""
        return self.stream_layers or job.prefill_done

    def _finished(self, job: _Job) -> bool:
        if job.state in (PrefillJobState.ABORTED, PrefillJobState.FAILED):
            return True
        wants_meta = job.req.meta_slot is not None and self.layout.tp_rank == 0
        meta_ok = job.meta_posted or not wants_meta
        return job.state is PrefillJobState.DRAINING and not job.pending and meta_ok

    def _post_layers(self, job: _Job, pages: list[int], layers: range) -> None:
        """One transfer per decode rank with these pages of these layers (one KV notification each)."""
        src_pages = np.asarray([job.src_pages[i] for i in pages], dtype=np.uint64)
        dst_pages = np.asarray([job.req.dst_pages[i] for i in pages], dtype=np.uint64)
        ranges: dict[int, np.ndarray] = {}
        counts: dict[int, int] = {}
        for d, slices in job.slices.items():
            dst_addrs, dst_pb = self._peer_pools[job.req.decode_ranks[d]]
            parts = []
            for layer in layers:
                src_base = self.pools[layer].data_ptr() + src_pages * self._page_bytes
                dst_base = dst_addrs[layer] + dst_pages * dst_pb
                for w in slices:
                    n = np.full(len(pages), w.length, dtype=np.uint64)
                    parts.append(np.stack([src_base + w.src_offset, dst_base + w.dst_offset, n], axis=1))
            ranges[d] = np.concatenate(parts)
            counts[d] = len(ranges[d])
        for d, rs in ranges.items():
            note = Notification(NotifKind.KV, job.req.request_id, job.req.epoch, counts[d])  # planned writes
            job.inflight.append(
                (self.transport.write(job.req.decode_ranks[d], _coalesce(rs), note.encode()), d, counts[d])
            )
            job.posted[d] = job.posted.get(d, 0) + counts[d]
            nbytes = int(rs[:, 2].sum())
            job.bytes_posted += nbytes

    def _post_meta(self, job: _Job) -> None:
        job.meta_posted = True
        if job.req.meta_slot is None or self.layout.tp_rank != 0 or job.meta is None:
            return
        ep = self._peers[job.req.decode_ranks[0]]
        if job.meta.numel() > ep.meta_slot_bytes or not 0 <= job.req.meta_slot < ep.meta_slots:
            with self._lock:
                job.state, job.error = PrefillJobState.FAILED, "metadata does not fit the decoder's slot"
            return
        slot = self._free_staging.popleft()  # one slot per job in DRAINING; returned in _close
        job.staging_slot = slot
        self._staging[slot, : job.meta.numel()] = job.meta
        dst = ep.meta_addr + job.req.meta_slot * ep.meta_slot_bytes
        note = Notification(NotifKind.META, job.req.request_id, job.req.epoch, 1)
        rng = [(self._staging[slot].data_ptr(), dst, job.meta.numel())]
        job.inflight.append((self.transport.write(ep.agent, rng, note.encode()), 0, 1))
        job.posted[0] = job.posted.get(0, 0) + 1

    def _close(self, job: _Job) -> None:
        kind = NotifKind.FIN if job.state is PrefillJobState.DRAINING else NotifKind.ABORTED
        targets = set(job.slices) | set(job.posted)
        for d in sorted(targets):
            note = Notification(kind, job.req.request_id, job.req.epoch, job.posted.get(d, 0))
            self.transport.send_notif(job.req.decode_ranks[d], note.encode())
        with self._lock:
            if job.state is PrefillJobState.DRAINING:
                job.state = PrefillJobState.DONE
        if job.staging_slot is not None:
            self._free_staging.append(job.staging_slot)
        with self._lock:
            if self._jobs.get(job.req.request_id) is job:
                del self._jobs[job.req.request_id]
            self._done.append(PrefillOutcome(job.req.request_id, job.state, job.error, job.bytes_posted))

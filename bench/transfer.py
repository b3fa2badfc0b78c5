"""``disagg bench transfer``: the KV messenger against raw NIXL and memcpy, and layer streaming on / off.

One run, two processes on this machine (the decode side in a child process, NIXL/UCX between):

1. Throughput, for SmolLM2's KV of a ``--tokens`` prompt and for a synthetic 64 MiB KV: the
   messenger (shard plan, transfers with notifications, counting) from submit to the decoder
   counting the last write; one raw NIXL WRITE of the same bytes (one range per layer pool,
   one notification); and an in-process ``copy_`` of the same bytes. One warm-up transfer each,
   then ``--repeats`` rounds in alternating order; medians.
2. Exposed KV transfer time while the engine really prefills the prompt (chunked): from the end
   of the prefill's last forward pass to the decoder having counted every KV write, with layer
   streaming on (each layer's pages leave as soon as the layer finishes) and off (everything
   leaves after the last forward pass). No metadata hand-off in this measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.transfer_decoder import AwaitRaw, Close, Connect, Decoder, Expect, Setup
from builders.arguments import engine_dir_of, engine_source_arguments
from kv_messenger.config import NixlBackend
from kv_messenger.layout import AttentionKind, KVLayoutSpec
from kv_messenger.prefill_side import PrefillSide, ProgressSource
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from kv_messenger.transport.base import TransferState
from kv_messenger.transport.nixl import NixlTransport
from serving.kv_links import PrefillLink, engine_layout
from torch_engine.config import NO_PREFIX_CACHE, DType, EngineConfig, KVLayout, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason
from torch_engine.sampling import SamplingParams
from torch_engine.scheduler import SchedulerOutput

DECODE_AGENT = "bench-decode"


class _AllDone:
    """Progress of a prefill that has already run: every layer of every forward is finished."""

    def completed(self, layer: int) -> int:
        return 1 << 40


def _pair(
    dec: Decoder,
    tag: str,
    layout: KVLayoutSpec,
    pools: list[torch.Tensor],
    progress: ProgressSource,
    stream_layers: bool = True,
    layers_per_post: int = 1,
) -> PrefillSide:
    ep = dec.call(Setup(layout.model_dump_json(), pools[0].shape[0], 0, f"{DECODE_AGENT}-{tag}")).endpoint_json
    side = PrefillSide(
        NixlTransport(f"bench-prefill-{tag}"), layout, pools, progress, stream_layers=stream_layers,
        layers_per_post=layers_per_post,
    )  # fmt: skip
    side.connect([RankEndpoint.model_validate_json(ep)])
    dec.call(Connect(side.endpoint().model_dump_json()))
    return side


def _request(rid: str, n_tokens: int, pages: list[int], agent: str, meta: bool) -> PrefillRequest:
    return PrefillRequest(
        request_id=rid,
        epoch=0,
        prompt_ids=[0] * (n_tokens + 1),
        dst_pages=pages,
        decode_ranks=[agent],
        meta_slot=0 if meta else None,
    )


def throughput(dec: Decoder, tag: str, layout: KVLayoutSpec, n_pages: int, repeats: int) -> Throughput:
    """Messenger vs raw NIXL vs memcpy GB/s for ``n_pages`` pages of every layer."""
    pools = [torch.randint(0, 255, (n_pages, layout.page_bytes), dtype=torch.uint8) for _ in range(layout.num_layers)]
    side = _pair(dec, tag, layout, pools, _AllDone())
    agent = f"{DECODE_AGENT}-{tag}"
    nbytes = n_pages * layout.page_bytes * layout.num_layers
    remote = side.peer_endpoint(agent).layer_addrs
    dst = [torch.empty_like(p) for p in pools]
    for d, src in zip(dst, pools, strict=True):
        d.copy_(src)  # fault the copy's destination in once: measure copies, not page faults

    def messenger_once(rep: int) -> float:
        rid = f"t{rep}"
        dec.call(Expect(rid, side.transport.name, n_pages, False))
        t0 = time.monotonic()
        side.submit(_request(rid, n_pages * layout.page_size, list(range(n_pages)), agent, False))
        side.schedule(rid, 1, n_pages * layout.page_size, True, list(range(n_pages)))
        while not side.completed():
            if not side.poll_once():
                time.sleep(side.poll_interval_s)
        got = dec.ready()
        if got.failed:
            raise RuntimeError(f"messenger transfer failed: {got.failed}")
        return nbytes / (got.at - t0) / 1e9

    def raw_once() -> float:
        ranges = [(p.data_ptr(), addr, p.numel()) for p, addr in zip(pools, remote, strict=True)]
        dec.conn.send(AwaitRaw())
        t0 = time.monotonic()
        handle = side.transport.write(agent, ranges, b"raw")
        while (state := side.transport.state(handle)) == TransferState.PENDING:
            pass
        if state == TransferState.FAILED:
            raise RuntimeError("the raw NIXL write failed")
        side.transport.release(handle)
        return nbytes / (dec.ready().at - t0) / 1e9

    def memcpy_once() -> float:
        t0 = time.monotonic()
        for d, src in zip(dst, pools, strict=True):
            d.copy_(src)
        return nbytes / (time.monotonic() - t0) / 1e9

    messenger, raw, memcpy = [], [], []
    try:
        messenger_once(-1)  # warm-up: the first transfer over a new connection is slower for both
        raw_once()
        for rep in range(repeats):  # alternate the order so that neither always runs on a warm path
            if rep % 2:
                raw.append(raw_once())
                messenger.append(messenger_once(rep))
            else:
                messenger.append(messenger_once(rep))
                raw.append(raw_once())
            memcpy.append(memcpy_once())
    finally:
        side.transport.close()
        dec.call(Close())
    m, r, c = statistics.median(messenger), statistics.median(raw), statistics.median(memcpy)
    return Throughput(bytes=nbytes, messenger_GBps=m, raw_nixl_GBps=r, memcpy_GBps=c, messenger_over_raw=m / r)


class _ForwardEnds:
    """Engine step observer: when each forward pass (every layer) ended."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def before_step(self, sched: SchedulerOutput) -> None:
        pass

    def after_forward(self, sched: SchedulerOutput) -> None:
        self.times.append(time.monotonic())


def _prefill_engine(engine_dir: Path, tokens: int, chunk: int, threads: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            engine_dir=engine_dir,
            num_threads=threads,
            page_size=16,
            num_pages=-(-tokens // 16) + 8,
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_prefill_chunk=chunk),
            prefix_cache=NO_PREFIX_CACHE,
        ),
        load_tokenizer=False,
    )


def _prompt(tokens: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def engine_alone(engine: LLMEngine, tokens: int) -> float:
    """The same prefill (all but the last prompt token) with no messenger at all: the prefill's own time."""
    forwards = _ForwardEnds()
    engine.attach(forwards)
    start = time.monotonic()
    rid = engine.add_request(_prompt(tokens)[:-1], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.retire(rid)
    return forwards.times[-1] - start


def exposed(dec: Decoder, opts: Options, posts: int | None, run: int) -> Exposure:
    """Prefill end -> decoder ready, while a fresh engine really runs the chunked prefill; ``posts``:
    layers per post (None: nothing is sent before the prefill ends)."""
    tokens = opts.tokens
    engine = _prefill_engine(opts.engine_dir, tokens, opts.chunk, opts.threads)
    kv = engine.kv_export()
    layout = engine_layout(kv)
    tag = f"exp{posts or 0}r{run}"
    agent = f"{DECODE_AGENT}-{tag}"
    side = _pair(dec, tag, layout, kv.pools, kv.progress, posts is not None, posts or 1)
    link = PrefillLink(engine, side)
    forwards = _ForwardEnds()
    engine.attach(forwards)
    prompt = _prompt(tokens)
    n_pages = -(-(tokens - 1) // layout.page_size)
    dec.call(Expect("x", side.transport.name, n_pages, False))
    side.start()
    try:
        start = time.monotonic()
        req = _request("x", tokens - 1, list(range(n_pages)), agent, False)
        link.submit(req.model_copy(update={"prompt_ids": prompt}))
        while not any(o.finish_reason is FinishReason.PREFILLED for o in link.step()):
            pass
        end = forwards.times[-1]
        got = dec.ready()
        if got.failed:
            raise RuntimeError(f"transfer failed: {got.failed}")
        while engine.has_request("x"):  # source pages go back once every write completed
            link.poll()
            time.sleep(1e-4)
    finally:
        side.stop()
        side.transport.close()
        dec.call(Close())
    return Exposure(
        prefill_s=end - start,
        exposed_ms=max(got.at - end, 0.0) * 1e3,  # KV that landed before the forward ended is hidden
        ready_minus_forward_end_ms=(got.at - end) * 1e3,
        kv_bytes=n_pages * layout.page_bytes * layout.num_layers,
    )


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One posting setting, medians over the repeats: the prefill's own time, the exposed transfer,
    and what streaming cost (prefill time above the engine alone) against what it hid."""

    layers_per_post: int | None  # None: sent after the prefill (not streamed)
    prefill_s: float
    exposed_ms: float
    ready_s: float  # prefill + exposed: when the decoder could start
    cost_ms: float  # prefill_s - the engine alone
    hidden_ms: float  # the unstreamed exposed time minus this one


def sweep(dec: Decoder, opts: Options, settings: list[int | None]) -> tuple[float, list[SweepPoint]]:
    """Every setting ``opts.repeats`` times, in alternating order, plus the engine alone; medians."""
    alone: list[float] = []
    runs: dict[int | None, list[Exposure]] = {s: [] for s in settings}
    for rep in range(opts.repeats):
        order = settings if rep % 2 == 0 else settings[::-1]
        alone.append(engine_alone(_prefill_engine(opts.engine_dir, opts.tokens, opts.chunk, opts.threads), opts.tokens))
        for s in order:
            runs[s].append(exposed(dec, opts, s, rep))
    base = statistics.median(alone)
    unstreamed = statistics.median(e.exposed_ms for e in runs[None]) if None in runs else 0.0
    points = []
    for s, es in runs.items():
        pre, exp = statistics.median(e.prefill_s for e in es), statistics.median(e.exposed_ms for e in es)
        points.append(SweepPoint(s, pre, exp, pre + exp / 1e3, (pre - base) * 1e3, unstreamed - exp))
    return base, points


@dataclass(frozen=True, slots=True)
class Options:
    engine_dir: Path
    tokens: int
    chunk: int
    threads: int
    repeats: int
    backend: NixlBackend
    json: Path | None
    posts: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])


@dataclass(frozen=True, slots=True)
class Throughput:
    bytes: int
    messenger_GBps: float
    raw_nixl_GBps: float
    memcpy_GBps: float
    messenger_over_raw: float


@dataclass(frozen=True, slots=True)
class Exposure:
    prefill_s: float
    exposed_ms: float
    ready_minus_forward_end_ms: float
    kv_bytes: int


@dataclass(slots=True)
class Report:
    backend: str
    tokens: int
    chunk: int
    repeats: int
    throughput: dict[str, Throughput] = field(default_factory=dict)
    engine_alone_s: float = 0.0  # the prefill with no messenger (its own time)
    sweep: list[SweepPoint] = field(default_factory=list)
    best_layers_per_post: int | None = None  # the setting whose KV is ready first
    goals_met: dict[str, bool] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    engine_source_arguments(p, DType.FLOAT32)
    p.add_argument("--tokens", type=int, default=2048, help="prompt length of the realistic request")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (token budget per step)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the prefill engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", choices=[b.value for b in NixlBackend], default=NixlBackend.UCX.value)
    p.add_argument("--posts", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                   help="layers_per_post settings to sweep (always also: not streamed)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write every figure and ratio here")


def run(a: argparse.Namespace) -> int:
    opts = Options(engine_dir_of(a), a.tokens, a.chunk, a.threads, a.repeats, NixlBackend(a.backend), a.json, a.posts)
    report = measure(opts)
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return 0


def _cases(opts: Options) -> dict[str, tuple[KVLayoutSpec, int]]:
    probe = LLMEngine(EngineConfig(engine_dir=opts.engine_dir, page_size=16, num_pages=4), load_tokenizer=False)
    smol = engine_layout(probe.kv_export())
    synthetic = KVLayoutSpec(
        kind=AttentionKind.GQA, num_layers=16, page_size=16, layout=KVLayout.HND, dtype=DType.BFLOAT16,
        kv_heads=8, head_dim=128,
    )  # fmt: skip
    return {
        f"smollm2_{opts.tokens}_tokens": (smol, -(-(opts.tokens - 1) // 16)),
        "synthetic_64MiB": (synthetic, (64 << 20) // (synthetic.page_bytes * synthetic.num_layers)),
    }


def measure(opts: Options) -> Report:
    dec = Decoder(opts.backend)
    report = Report(opts.backend.value, opts.tokens, opts.chunk, opts.repeats)
    try:
        cases = _cases(opts)
        for name, (layout, n_pages) in cases.items():
            r = report.throughput[name] = throughput(dec, name.split("_")[0], layout, n_pages, opts.repeats)
            print(
                f"{name}: {r.bytes / 2**20:.0f} MiB  messenger {r.messenger_GBps:.2f} GB/s  raw NIXL "
                f"{r.raw_nixl_GBps:.2f} GB/s (x{r.messenger_over_raw:.2f})  memcpy {r.memcpy_GBps:.2f} GB/s"
            )
        base, points = sweep(dec, opts, [None, *opts.posts])
        report.engine_alone_s, report.sweep = base, points
        best = min(points, key=lambda p: p.ready_s)
        report.best_layers_per_post = best.layers_per_post
        print(f"{opts.tokens}-token prefill, engine alone {base:.3f} s")
        for p in points:
            what = "not streamed" if p.layers_per_post is None else f"every {p.layers_per_post} layers"
            print(
                f"  {what:18s} prefill {p.prefill_s:.3f} s (cost {p.cost_ms:+.0f} ms)  exposed {p.exposed_ms:.1f} ms "
                f"(hid {p.hidden_ms:.1f} ms)  KV ready after {p.ready_s:.3f} s"
            )
        off = next(p for p in points if p.layers_per_post is None)
        streamed = [p for p in points if p.layers_per_post is not None]
        worst = min(t.messenger_over_raw for t in report.throughput.values())
        report.goals_met = {
            "messenger_at_least_80pct_of_raw": worst >= 0.8,
            "streamed_exposed_at_most_25pct": min(p.exposed_ms for p in streamed) <= 0.25 * max(off.exposed_ms, 1e-9),
            "best_setting_costs_no_more_than_it_hides": best.cost_ms - (off.cost_ms) <= best.hidden_ms + 1e-9,
        }
        print("goals: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report.goals_met.items()))
    finally:
        dec.stop()
    return report

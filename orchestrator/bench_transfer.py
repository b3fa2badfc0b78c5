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
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from kv_messenger.decode_side import DecodeSide
from kv_messenger.engine_link import PrefillLink, engine_layout
from kv_messenger.layout import AttentionKind, KVLayoutSpec
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from kv_messenger.transport.base import TransferState
from kv_messenger.transport.nixl import NixlTransport
from torch_engine.config import EngineConfig, KVLayout
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason

DECODE_AGENT = "bench-decode"


class _AllDone:
    """Progress of a prefill that has already run: every layer of every forward is finished."""

    def completed(self, layer: int) -> int:
        return 1 << 40


def _decode_process(conn: Connection, backend: str) -> None:
    torch.set_num_threads(1)
    side: DecodeSide | None = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "setup":
            layout, num_pages, meta_bytes, agent = arg
            spec = KVLayoutSpec.model_validate_json(layout)
            pools = [torch.zeros(num_pages, spec.page_bytes, dtype=torch.uint8) for _ in range(spec.num_layers)]
            side = DecodeSide(NixlTransport(agent, backend), spec, pools, meta_bytes, 1 if meta_bytes else 0)
            conn.send(side.endpoint().model_dump_json())
        elif cmd == "connect":
            assert side is not None
            side.connect([RankEndpoint.model_validate_json(arg)])
            conn.send("ok")
        elif cmd == "expect":  # count until ready, then answer with the time it happened
            assert side is not None
            rid, agent, n_pages, meta = arg
            side.expect(rid, 0, [agent], n_pages, 0, meta, 120)
            conn.send("ok")
            while True:
                polled = side.poll()
                if polled.ready or polled.failed:
                    conn.send((time.monotonic(), polled.failed))
                    break
                time.sleep(20e-6)
        elif cmd == "raw":  # wait for the raw write's notification
            assert side is not None
            while not [n for n in side.transport.notifications() if n[1] == b"raw"]:
                time.sleep(20e-6)
            conn.send(time.monotonic())
        elif cmd == "close":
            if side is not None:
                side.transport.close()
            side = None
            conn.send("ok")
        elif cmd == "exit":
            return


class _Decoder:
    def __init__(self, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_process, args=(child, backend), daemon=True)
        self.proc.start()

    def call(self, cmd: str, arg: object = None) -> object:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("exit", None))
        self.proc.join(10)


def _pair(
    dec: _Decoder, tag: str, layout: KVLayoutSpec, pools: list[torch.Tensor], progress: object, meta: int, **kw: object
) -> PrefillSide:
    ep = dec.call("setup", (layout.model_dump_json(), pools[0].shape[0], meta, f"{DECODE_AGENT}-{tag}"))
    side = PrefillSide(NixlTransport(f"bench-prefill-{tag}"), layout, pools, progress, meta_slot_bytes=meta, **kw)  # type: ignore[arg-type]
    side.connect([RankEndpoint.model_validate_json(ep)])  # type: ignore[arg-type]
    dec.call("connect", side.endpoint().model_dump_json())
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


def throughput(dec: _Decoder, tag: str, layout: KVLayoutSpec, n_pages: int, repeats: int) -> dict[str, float]:
    """Messenger vs raw NIXL vs memcpy GB/s for ``n_pages`` pages of every layer."""
    pools = [torch.randint(0, 255, (n_pages, layout.page_bytes), dtype=torch.uint8) for _ in range(layout.num_layers)]
    side = _pair(dec, tag, layout, pools, _AllDone(), 0)
    agent = f"{DECODE_AGENT}-{tag}"
    nbytes = n_pages * layout.page_bytes * layout.num_layers
    remote = side.peer_endpoint(agent).layer_addrs
    dst = [torch.empty_like(p) for p in pools]
    for d, src in zip(dst, pools, strict=True):
        d.copy_(src)  # fault the copy's destination in once: measure copies, not page faults

    def messenger_once(rep: int) -> float:
        rid = f"t{rep}"
        dec.call("expect", (rid, side.transport.name, n_pages, False))
        t0 = time.monotonic()
        side.submit(_request(rid, n_pages * layout.page_size, list(range(n_pages)), agent, False))
        side.schedule(rid, 1, n_pages * layout.page_size, True, list(range(n_pages)))
        while not side.completed():
            if not side.poll_once():
                time.sleep(side.poll_interval_s)
        ready, failed = dec.conn.recv()  # type: ignore[misc]
        if failed:
            raise RuntimeError(f"messenger transfer failed: {failed}")
        return nbytes / (ready - t0) / 1e9

    def raw_once() -> float:
        ranges = [(p.data_ptr(), addr, p.numel()) for p, addr in zip(pools, remote, strict=True)]
        dec.conn.send(("raw", None))
        t0 = time.monotonic()
        handle = side.transport.write(agent, ranges, b"raw")
        while (state := side.transport.state(handle)) == TransferState.PENDING:
            pass
        if state == TransferState.FAILED:
            raise RuntimeError("the raw NIXL write failed")
        side.transport.release(handle)
        return nbytes / (dec.conn.recv() - t0) / 1e9

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
        dec.call("close")
    m, r, c = statistics.median(messenger), statistics.median(raw), statistics.median(memcpy)
    return {"bytes": nbytes, "messenger_GBps": m, "raw_nixl_GBps": r, "memcpy_GBps": c, "messenger_over_raw": m / r}


def exposed(dec: _Decoder, engine_dir: Path, tokens: int, chunk: int, stream: bool, threads: int) -> dict[str, float]:
    """Prefill end -> decoder ready, while the engine really runs the chunked prefill."""
    n_pages_needed = -(-tokens // 16) + 8
    engine = LLMEngine(
        EngineConfig(
            engine_dir=engine_dir,
            num_threads=threads,
            page_size=16,
            num_pages=n_pages_needed,
            max_num_batched_tokens=chunk,
            max_prefill_chunk=chunk,
        ),
        load_tokenizer=False,
    )
    layout = engine_layout(engine)
    tag = f"exp{int(stream)}"
    agent = f"{DECODE_AGENT}-{tag}"
    side = _pair(dec, tag, layout, engine.kv.pools, engine.progress, 0, stream_layers=stream)
    link = PrefillLink(engine, side)
    forward_ends: list[float] = []
    execute = engine.runner.execute

    def timed_execute(inputs: object) -> torch.Tensor:  # when each forward pass (all layers) ends
        out = execute(inputs)  # type: ignore[arg-type]
        forward_ends.append(time.monotonic())
        return out

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
    n_pages = -(-(tokens - 1) // layout.page_size)
    dec.call("expect", ("x", side.transport.name, n_pages, False))
    side.start()
    try:
        start = time.monotonic()
        req = _request("x", tokens - 1, list(range(n_pages)), agent, False)
        link.submit(req.model_copy(update={"prompt_ids": prompt}))
        while not any(o.finish_reason is FinishReason.PREFILLED for o in link.step()):
            pass
        end = forward_ends[-1]
        ready, failed = dec.conn.recv()  # type: ignore[misc]
        if failed:
            raise RuntimeError(f"transfer failed: {failed}")
        while "x" in engine.requests:  # source pages go back once every write completed
            link.reap()
            time.sleep(1e-4)
    finally:
        side.stop()
        side.transport.close()
        dec.call("close")
    return {
        "prefill_s": end - start,
        "exposed_ms": max(ready - end, 0.0) * 1e3,  # KV that landed before the forward ended is hidden
        "ready_minus_forward_end_ms": (ready - end) * 1e3,
        "kv_bytes": n_pages * layout.page_bytes * layout.num_layers,
    }


def run_transfer_bench(a: argparse.Namespace, engine_dir_of: Callable[[argparse.Namespace], Path]) -> int:
    engine_dir = engine_dir_of(a)
    dec = _Decoder(a.backend)
    results: dict[str, object] = {"backend": a.backend, "tokens": a.tokens, "chunk": a.chunk, "repeats": a.repeats}
    try:
        probe = LLMEngine(EngineConfig(engine_dir=engine_dir, page_size=16, num_pages=4), load_tokenizer=False)
        smol = engine_layout(probe)
        del probe
        synthetic = KVLayoutSpec(
            kind=AttentionKind.GQA,
            num_layers=16,
            page_size=16,
            layout=KVLayout.HND,
            dtype="bfloat16",
            kv_heads=8,
            head_dim=128,
        )
        cases = {
            f"smollm2_{a.tokens}_tokens": (smol, -(-(a.tokens - 1) // 16)),
            "synthetic_64MiB": (synthetic, (64 << 20) // (synthetic.page_bytes * synthetic.num_layers)),
        }
        for name, (layout, n_pages) in cases.items():
            r = throughput(dec, name.split("_")[0], layout, n_pages, a.repeats)
            results[name] = r
            print(
                f"{name}: {r['bytes'] / 2**20:.0f} MiB  messenger {r['messenger_GBps']:.2f} GB/s  raw NIXL "
                f"{r['raw_nixl_GBps']:.2f} GB/s (x{r['messenger_over_raw']:.2f})  memcpy {r['memcpy_GBps']:.2f} GB/s"
            )
        on = exposed(dec, engine_dir, a.tokens, a.chunk, True, a.threads)
        off = exposed(dec, engine_dir, a.tokens, a.chunk, False, a.threads)
        results["exposed"] = {
            "streaming": on,
            "not_streamed": off,
            "streamed_over_not": on["exposed_ms"] / max(off["exposed_ms"], 1e-9),
        }
        print(
            f"exposed transfer after a {a.tokens}-token prefill ({on['prefill_s']:.1f} s): "
            f"streaming {on['exposed_ms']:.1f} ms, "
            f"not streamed {off['exposed_ms']:.1f} ms (x{results['exposed']['streamed_over_not']:.2f})"
        )
        worst = min(results[n]["messenger_over_raw"] for n in cases)  # type: ignore[index]
        results["goals_met"] = {
            "messenger_at_least_80pct_of_raw": worst >= 0.8,
            "streamed_exposed_at_most_25pct": on["exposed_ms"] <= 0.25 * off["exposed_ms"],
        }
        print("goals: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in results["goals_met"].items()))  # type: ignore[union-attr]
    finally:
        dec.stop()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0

"""A process hosting one side (prefill or decode) of several messenger ranks over real NIXL/UCX.

The parent test drives it over a pipe: ``setup`` (make agents and pools, return endpoints),
``connect`` (peer endpoints), then ``run`` (prefill: stream the chunks; decode: expect, poll
until ready, compare every page with the reference bytes), then ``close``.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from kv_messenger.decode_side import DecodeSide
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from kv_messenger.transport.nixl import NixlTransport
from tests.messenger_harness import LAYERS, FakeProgress, Scenario, make_pools, spec

META_BYTES = 256


def ask(conn: Connection, cmd: str, arg: object = None, timeout: float = 120) -> object:
    """Parent side: send a command to a node and wait for its answer (an error answer fails the test)."""
    conn.send((cmd, arg))
    if not conn.poll(timeout):
        raise TimeoutError(f"node did not answer {cmd!r} in {timeout}s")
    out = conn.recv()
    if isinstance(out, str) and out.startswith("error:"):
        raise AssertionError(out)
    return out


def serve(conn: Connection, side: str) -> None:
    torch.set_num_threads(1)
    sides: list = []
    progress: list[FakeProgress] = []
    sc: Scenario | None = None
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "setup":
                sc, tag = arg
                tp = sc.prefill_tp if side == "prefill" else sc.decode_tp
                logical = sc.logical() if side == "prefill" else None
                for r in range(tp):
                    lay = spec(sc.kind, sc.layout, sc.page_size, tp, r)
                    t = NixlTransport(f"{tag}-{side[0]}{r}")
                    if side == "prefill":
                        pr = FakeProgress(LAYERS)
                        progress.append(pr)
                        sides.append(PrefillSide(t, lay, make_pools(lay, logical), pr, meta_slot_bytes=META_BYTES))
                    else:
                        sides.append(DecodeSide(t, lay, make_pools(lay, None), META_BYTES, 2))
                conn.send([s.endpoint().model_dump_json() for s in sides])
            elif cmd == "connect":
                peers = [RankEndpoint.model_validate_json(j) for j in arg]
                for s in sides:
                    s.connect(peers)
                conn.send("ok")
            elif cmd == "expect":
                agents, n_pages = arg
                for s in sides:
                    s.expect("req", 0, agents, n_pages, seed=7, meta=True, timeout_s=30)
                conn.send("ok")
            elif cmd == "run" and side == "prefill":
                assert sc is not None
                conn.send(run_prefill(sides, progress, sc, PrefillRequest.model_validate_json(arg)))
            elif cmd == "run":
                assert sc is not None
                conn.send(run_decode(sides, sc))
            elif cmd == "close":
                for s in sides:
                    if side == "prefill":
                        s.stop()
                    s.transport.close()
                sides, progress = [], []
                conn.send("ok")
            elif cmd == "exit":
                conn.send("bye")
                return
        except Exception as exc:  # reported to the parent test, which fails with it
            conn.send(f"error: {type(exc).__name__}: {exc}")


def run_prefill(sides: list[PrefillSide], progress: list[FakeProgress], sc: Scenario, req: PrefillRequest) -> str:
    src_pages, _ = sc.pages()
    for s in sides:
        s.submit(req)
        s.start()  # the messenger thread polls the counters
    chunks = sc.chunks()
    for step, done in enumerate(chunks, start=1):
        for s in sides:
            s.schedule(req.request_id, step, done, step == len(chunks), src_pages)
        for layer in range(LAYERS):  # layers finish one by one, as in a forward pass
            for pr in progress:
                pr.counts[layer] = step
            time.sleep(0.001)
    sides[0].set_metadata(req.request_id, torch.arange(META_BYTES, dtype=torch.int32).to(torch.uint8))
    deadline = time.monotonic() + 30
    states: list[str] = []
    while len(states) < len(sides) and time.monotonic() < deadline:
        for s in sides:
            states += [o.state.name for o in s.completed()]
        time.sleep(0.001)
    return ",".join(states)


def run_decode(sides: list[DecodeSide], sc: Scenario) -> str:
    logical = sc.logical()
    deadline = time.monotonic() + 30
    pending = set(range(len(sides)))
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            polled = sides[r].poll()
            if polled.failed:
                return f"rank {r} failed: {polled.failed}"
            if polled.ready:
                pending.discard(r)
        time.sleep(0.001)
    if pending:
        return f"ranks {sorted(pending)} not ready"
    for r, s in enumerate(sides):
        want, pages = sc.expected_dst(logical, r)
        for layer in range(LAYERS):
            if not np.array_equal(s.pools[layer][pages].numpy(), want[layer]):
                return f"rank {r} layer {layer}: pages differ"
    meta = sides[0].meta_slot(1)[:META_BYTES]
    if not torch.equal(meta, torch.arange(META_BYTES, dtype=torch.int32).to(torch.uint8)):
        return "metadata differs"
    return "identical"


if __name__ == "__main__":  # a node in another network namespace: commands over a Unix socket (netns-proof)
    import sys
    from multiprocessing.connection import Client

    address, which, key = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    serve(Client(address, family="AF_UNIX", authkey=key), which)

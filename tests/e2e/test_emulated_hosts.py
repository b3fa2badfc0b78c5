"""The KV messenger between emulated hosts (network namespaces on a bridge, ``tests/netns.py``): the
prefill side on host 0 and the decode side on host 1, NIXL over UCX forced onto TCP (these "hosts"
share a kernel, so UCX would otherwise take shared memory), every byte compared, and the bytes
seen crossing the decode host's interface (its receive counter grew by at least the KV volume)."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import pytest

from kv_messenger.layout import AttentionKind
from kv_messenger.protocol import PrefillRequest
from tests.messenger_harness import LAYERS, NUM_PAGES, Scenario, spec
from tests.netns import EmulatedHosts, available
from tests.nixl_node import ask
from torch_engine.config import KVLayout

REPO = Path(__file__).resolve().parents[2]
WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no emulated hosts: {WHY}")
UCX_OVER_TCP = ["UCX_TLS=tcp,self", "UCX_NET_DEVICES=eth0"]  # the hosts' one network interface


class RemoteNode:
    """``tests/nixl_node.py`` on an emulated host, driven over a Unix socket (which no netns hides)."""

    def __init__(self, hosts: EmulatedHosts, host: int, side: str, tmp: Path) -> None:
        key = secrets.token_hex(8)
        path = str(tmp / f"{side}.sock")
        listener = Listener(path, family="AF_UNIX", authkey=key.encode())
        argv = ["env", *UCX_OVER_TCP, f"PYTHONPATH={REPO}", sys.executable, "-m", "tests.nixl_node", path, side, key]
        self.proc = subprocess.Popen(hosts.run(host, argv), cwd=REPO)
        got: list[Connection] = []
        waiter = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
        waiter.start()
        waiter.join(60)
        listener.close()
        if not got:
            self.proc.kill()
            raise RuntimeError(f"the {side} node on {hosts.names[host]} did not connect")
        self.conn = got[0]

    def call(self, cmd: str, arg: object = None, timeout: float = 120) -> object:
        return ask(self.conn, cmd, arg, timeout)

    def close(self) -> None:
        try:
            self.call("exit", timeout=10)
        finally:
            self.proc.wait(10)


@pytest.fixture(scope="module")
def hosts() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(2) as h:
        yield h


@pytest.mark.parametrize(
    "sc",
    [
        Scenario(AttentionKind.GQA, KVLayout.HND, 16, 2, 1, prompt_len=NUM_PAGES * 16 - 8, chunk=64),
        Scenario(AttentionKind.MLA, KVLayout.HND, 16, 1, 2, prompt_len=NUM_PAGES * 16 - 8, chunk=100),
    ],
    ids=["gqa-tp2to1", "mla-tp1to2"],
)
def test_kv_crosses_the_emulated_network_byte_for_byte(hosts: EmulatedHosts, sc: Scenario, tmp_path: Path) -> None:
    pre = RemoteNode(hosts, 0, "prefill", tmp_path)
    dec = RemoteNode(hosts, 1, "decode", tmp_path)
    try:
        tag = f"h{sc.kind.value}{sc.prefill_tp}{sc.decode_tp}"
        pre_eps, dec_eps = pre.call("setup", (sc, tag)), dec.call("setup", (sc, tag))
        pre.call("connect", dec_eps)
        dec.call("connect", pre_eps)
        _, dst_pages = sc.pages()
        dec.call("expect", ([f"{tag}-p{r}" for r in range(sc.prefill_tp)], len(dst_pages)))
        ranks = [f"{tag}-d{r}" for r in range(sc.decode_tp)]
        prompt = list(range(sc.prompt_len))
        req = PrefillRequest(
            request_id="req", epoch=0, prompt_ids=prompt, dst_pages=dst_pages, decode_ranks=ranks, seed=7, meta_slot=1
        )
        before = hosts.rx_bytes(1)
        dec.conn.send(("run", None))
        assert pre.call("run", req.model_dump_json()) == ",".join(["DONE"] * sc.prefill_tp)
        assert dec.conn.poll(60)
        assert dec.conn.recv() == "identical"
        received = hosts.rx_bytes(1) - before
        kv = sum(spec(sc.kind, sc.layout, sc.page_size, sc.decode_tp, r).page_bytes for r in range(sc.decode_tp))
        volume = kv * len(dst_pages) * LAYERS
        assert received >= volume, f"{received} bytes reached the decode host, the KV alone is {volume}"
        pre.call("close")
        dec.call("close")
    finally:
        pre.close()
        dec.close()

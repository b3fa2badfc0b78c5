"""Emulated hosts: network namespaces joined by veth pairs to a bridge, for multi-host tests.

    EmulatedHosts(3) -> hosts h0, h1, h2, each a network namespace with an ``eth0`` at
    10.231.N.1 / .2 / .3 (N picked per run) and its own loopback; a fourth namespace holds the
    bridge ("the switch"). Every address lives inside namespaces this fixture creates; nothing is
    added to the machine's own network. ``run(host, argv)`` prefixes ``ip netns exec``;
    ``rx_bytes`` / ``tx_bytes`` read a host's interface counters; every host's name resolves on every
    host (``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts as ``/etc/hosts``); ``close()``
    (always, also on failure: a context manager) deletes the namespaces, and with them the veth pairs.
    ``scripts/netns_agent.sh`` is the launch agent mpirun uses to start ranks on these hosts.

By hand (as root): ``python -m tests.netns up 3`` prints the hosts and their addresses,
``python -m tests.netns down`` removes every namespace this module made (their names start with
``dsg``). Creating namespaces needs CAP_NET_ADMIN (root in a container that grants it); where it is
missing, ``available()`` says why and the tests that need it skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "dsg"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None if emulated hosts can be made here, else the reason they cannot."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed"
    try:
        Path("/etc/netns").mkdir(exist_ok=True)
    except OSError as exc:
        return f"cannot write /etc/netns (host names of emulated hosts): {exc}"
    uts = subprocess.run(["unshare", "--uts", "true"], check=False, capture_output=True, text=True)
    if uts.returncode != 0:
        return f"cannot give emulated hosts their own host names (unshare --uts): {uts.stderr.strip()}"
    name = f"{PREFIX}probe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        return "the 'ip' command (iproute2) is not installed"
    except subprocess.CalledProcessError as exc:
        return f"cannot create network namespaces here: {exc.stderr.strip()}"
    _ip("netns", "del", name)
    return None


@dataclass
class EmulatedHosts:
    count: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    names: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        net = 10 + os.getpid() % 200
        self.switch = f"{PREFIX}{self.tag}sw"
        self._made: list[str] = []
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.count):
                ns, addr = f"{PREFIX}{self.tag}h{i}", f"10.231.{net}.{i + 1}"
                self._add(ns)
                port = f"p{i}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.names.append(ns)
                self.addresses.append(addr)
            for ns in self.names:  # names resolve on every host (``ip netns exec`` mounts this as /etc/hosts)
                folder = Path("/etc/netns") / ns
                folder.mkdir(parents=True, exist_ok=True)
                lines = "".join(f"{a} {n}\n" for n, a in zip(self.names, self.addresses, strict=True))
                (folder / "hosts").write_text(f"127.0.0.1 localhost\n{lines}", encoding="utf-8")
        except BaseException:
            self.close()
            raise

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def run(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs on emulated host ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def _counter(self, host: int, which: str) -> int:
        out = subprocess.run(
            self.run(host, ["cat", f"/sys/class/net/eth0/statistics/{which}"]), check=True, capture_output=True
        )
        return int(out.stdout)

    def rx_bytes(self, host: int) -> int:
        return self._counter(host, "rx_bytes")

    def tx_bytes(self, host: int) -> int:
        return self._counter(host, "tx_bytes")

    def close(self) -> None:
        for ns in self._made:
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        self._made.clear()

    def __enter__(self) -> EmulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _down() -> None:
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout.split()
    for ns in [n for n in listed if n.startswith(PREFIX)]:
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        print("removed", ns)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "up":
        hosts = EmulatedHosts(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
        for name, addr in zip(hosts.names, hosts.addresses, strict=True):
            print(f"{name} {addr}   (ip netns exec {name} <command>)")
    elif len(sys.argv) >= 2 and sys.argv[1] == "down":
        _down()
    else:
        sys.exit("usage: python -m tests.netns up [N] | down")

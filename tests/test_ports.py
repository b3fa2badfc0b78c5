"""``free_port``: outside the kernel's ephemeral range, and never handed out twice while reserved."""

from __future__ import annotations

import socket

from serving.ports import candidate_ports, ephemeral_range, free_port, port_free


def test_free_ports_are_outside_the_ephemeral_range_and_free() -> None:
    low, high = ephemeral_range()
    picked = [free_port() for _ in range(50)]
    assert all(not low <= p <= high for p in picked), picked
    assert all(p in candidate_ports() for p in picked)
    assert all(port_free("127.0.0.1", p) for p in picked)


def test_a_reserved_port_is_not_handed_out_again() -> None:
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)


def test_a_bound_port_is_not_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not port_free("127.0.0.1", s.getsockname()[1])

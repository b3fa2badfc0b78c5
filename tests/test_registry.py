"""The deployment's membership registry: records published whole, read, withdrawn, waited for, and
the running view's changes (groups that died, groups that came back with a new generation)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from serving.registry import GroupRecord, Member, Membership, Registry
from torch_engine.config import Role


def record(role: Role, group: int, generation: int = 0) -> GroupRecord:
    members = [Member(tp_rank=r, host="10.0.0.1", grpc_url="10.0.0.1:8001" if r == 0 else None) for r in (1, 0)]
    return GroupRecord(role=role, group=group, generation=generation, members=members)


def test_publish_read_withdraw(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "registry")
    assert reg.read() == {}
    reg.publish(record(Role.PREFILL, 0))
    reg.publish(record(Role.DECODE, 1))
    found = reg.read()
    assert set(found) == {(Role.PREFILL, 0), (Role.DECODE, 1)}
    assert found[(Role.PREFILL, 0)].leader.tp_rank == 0 and found[(Role.PREFILL, 0)].leader.grpc_url
    assert not list((tmp_path / "registry").glob("*.tmp"))  # written whole, renamed into place
    assert reg.withdraw(Role.PREFILL, 0) and not reg.withdraw(Role.PREFILL, 0)
    assert set(reg.read()) == {(Role.DECODE, 1)}


def test_wait_names_the_groups_that_never_came(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    threading.Timer(0.1, lambda: reg.publish(record(Role.DECODE, 0))).start()
    assert set(reg.wait([(Role.DECODE, 0)], timeout_s=5)) == {(Role.DECODE, 0)}
    with pytest.raises(TimeoutError, match="prefill1"):
        reg.wait([(Role.DECODE, 0), (Role.PREFILL, 1)], timeout_s=0.2)


def test_a_bad_record_is_skipped_and_named_not_fatal(tmp_path: Path) -> None:
    """A record of another protocol version, or a corrupt one, is no member: the good ones are read,
    the bad ones named (a start-up that waits for them says why they never came)."""
    reg = Registry(tmp_path)
    reg.publish(record(Role.PREFILL, 0).model_copy(update={"version": 999}))
    reg.publish(record(Role.DECODE, 0))
    (tmp_path / "prefill1.json").write_bytes(b"\xff{not json")
    assert set(reg.read()) == {(Role.DECODE, 0)}
    assert "protocol 999" in reg.rejected["prefill0.json"] and "invalid" in reg.rejected["prefill1.json"]
    with pytest.raises(TimeoutError, match="protocol 999"):
        reg.wait([(Role.PREFILL, 0)], timeout_s=0.1)


def test_membership_reports_deaths_and_new_generations(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    first = [record(Role.PREFILL, 0), record(Role.PREFILL, 1), record(Role.DECODE, 0)]
    for r in first:
        reg.publish(r)
    view = Membership(reg, Role.PREFILL, first, poll_s=0.0)
    assert view.poll() is None  # nothing changed since start-up
    reg.withdraw(Role.PREFILL, 1)
    change = view.poll()
    assert change is not None and change.left == [(Role.PREFILL, 1)] and change.joined == []
    time.sleep(0.01)
    reg.publish(record(Role.PREFILL, 1, generation=1))  # restarted
    reg.publish(record(Role.DECODE, 0, generation=1))  # another role: not this view's business
    change = view.poll()
    assert change is not None and [(r.group, r.generation) for r in change.joined] == [(1, 1)]
    assert view.poll() is None
    slow = Membership(reg, Role.PREFILL, [], poll_s=3600)
    assert slow.poll(force=True) is not None  # a forced look ignores the interval

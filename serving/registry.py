"""Deployment membership: which groups are up, and how to reach their ranks.

Each group runs as its own ``mpirun`` job (``orchestrator/launch.py``), so that one group's death
costs only that group. Groups find each other through the registry, a directory the launcher
creates in the run directory (which every host already shares: the node configs live there):

    registry/<role><group>.json   one ``GroupRecord`` per live group, written by its leader once the
                                  group is up (atomically: a temporary file renamed into place)

Writers: a group leader publishes its record after its group-local exchange (``bootstrap``); the
launcher withdraws it when any rank of the group dies, before restarting the group, whose new
leader publishes a record with the next ``generation`` (its ranks have new NIXL agents). Readers:
every rank waits at start-up for the groups it must reach; running leaders poll ``Membership``
between steps and connect to, route to, or stop routing to groups as records appear, change and
disappear. One writer per file and whole-file replacement: no consensus protocol is needed (the
launcher is the only authority on a group's death).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from kv_messenger.layout import PROTOCOL_VERSION
from kv_messenger.protocol import RankEndpoint
from torch_engine.config import Role

GroupKey = tuple[Role, int]


log = logging.getLogger(__name__)


class Member(BaseModel):
    """One rank of a group, as its peers see it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tp_rank: int
    host: str
    grpc_url: str | None = None  # the leader's Triton endpoint
    endpoint: RankEndpoint | None = None  # its messenger (None: colocated)


class GroupRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = PROTOCOL_VERSION
    role: Role
    group: int
    generation: int  # restarts of this group so far: a new generation has new agents
    members: list[Member]

    @property
    def key(self) -> GroupKey:
        return (self.role, self.group)

    @property
    def leader(self) -> Member:
        return min(self.members, key=lambda m: m.tp_rank)

    @property
    def agents(self) -> list[str]:
        return [m.endpoint.agent for m in sorted(self.members, key=lambda m: m.tp_rank) if m.endpoint is not None]

    @property
    def endpoints(self) -> list[RankEndpoint]:
        return [m.endpoint for m in sorted(self.members, key=lambda m: m.tp_rank) if m.endpoint is not None]


def record_name(role: Role, group: int) -> str:
    return f"{role.value}{group}.json"


class Registry:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.rejected: dict[str, str] = {}  # record file -> why it was skipped (the last read)

    def publish(self, record: GroupRecord) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / record_name(record.role, record.group)
        tmp = final.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(record.model_dump_json(), encoding="utf-8")
        tmp.replace(final)

    def withdraw(self, role: Role, group: int) -> bool:
        """Remove a group's record (the launcher, when the group died); True if there was one."""
        try:
            (self.path / record_name(role, group)).unlink()
        except FileNotFoundError:
            return False
        return True

    def read(self) -> dict[GroupKey, GroupRecord]:
        """Every published record (a file being replaced is read whole: renames are atomic)."""
        out: dict[GroupKey, GroupRecord] = {}
        rejected: dict[str, str] = {}
        if not self.path.is_dir():
            return out
        for f in sorted(self.path.glob("*.json")):
            with contextlib.suppress(FileNotFoundError):  # withdrawn meanwhile
                try:
                    rec = GroupRecord.model_validate_json(f.read_text(encoding="utf-8"))
                except (ValidationError, UnicodeDecodeError) as exc:  # a bad record is not a member: skipped
                    rejected[f.name] = f"invalid: {str(exc)[:300]}"
                    continue
                if rec.version != PROTOCOL_VERSION:
                    rejected[f.name] = f"speaks protocol {rec.version}, this rank {PROTOCOL_VERSION}"
                    continue
                out[rec.key] = rec
        for name in set(rejected) - set(self.rejected):
            log.warning("registry record %s skipped: %s", name, rejected[name])
        self.rejected = rejected
        return out

    def wait(self, keys: Iterable[GroupKey], timeout_s: float, poll_s: float = 0.05) -> dict[GroupKey, GroupRecord]:
        """Block until every group in ``keys`` has published (start-up); TimeoutError names the missing."""
        want = set(keys)
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.read()
            missing = want - set(found)
            if not missing:
                return found
            if time.monotonic() > deadline:
                names = ", ".join(f"{r.value}{g}" for r, g in sorted(missing, key=lambda k: (k[0].value, k[1])))
                skipped = "".join(f"; record {n} skipped ({why})" for n, why in sorted(self.rejected.items()))
                raise TimeoutError(f"groups not up after {timeout_s:.0f} s: {names}{skipped}")
            time.sleep(poll_s)


@dataclass(slots=True)
class MembershipChange:
    joined: list[GroupRecord]  # new groups, and new generations of known ones
    left: list[GroupKey]  # groups whose record was withdrawn


class Membership:
    """A running leader's view of the groups of one role, refreshed by ``poll`` (cheap: one
    directory listing; records are read only when the listing's mtimes changed)."""

    def __init__(self, registry: Registry, role: Role, known: Iterable[GroupRecord], poll_s: float = 0.5) -> None:
        self.registry = registry
        self.role = role
        self.poll_s = poll_s
        self.known: dict[GroupKey, GroupRecord] = {r.key: r for r in known if r.role is role}
        self._next = 0.0
        self._stamp: tuple[tuple[str, int], ...] = ()

    def poll(self, force: bool = False) -> MembershipChange | None:
        """What changed since the last look (at most every ``poll_s``, unless ``force``)."""
        now = time.monotonic()
        if now < self._next and not force:
            return None
        self._next = now + self.poll_s
        stamp = self._listing()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        current = {k: r for k, r in self.registry.read().items() if k[0] is self.role}
        joined = [r for k, r in current.items() if k not in self.known or self.known[k].generation != r.generation]
        left = [k for k in self.known if k not in current]
        self.known = current
        return MembershipChange(joined, left) if joined or left else None

    def _listing(self) -> tuple[tuple[str, int], ...]:
        out = []
        for f in sorted(self.registry.path.glob(f"{self.role.value}*.json")):
            with contextlib.suppress(FileNotFoundError):
                out.append((f.name, f.stat().st_mtime_ns))
        return tuple(out)

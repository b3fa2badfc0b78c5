"""The TP group's tick protocol, as data: the leader's commands to its followers' messenger sides
(``PrefillCommand`` to prefill ranks, ``DecodeCommand`` to decode ranks), the tick that carries
them with a step's inputs, and the report each follower gathers back. ``serving/tp_group.py``
sends and applies them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_messenger.prefill_side import PrefillOutcome
from kv_messenger.protocol import PrefillRequest, RankEndpoint
from torch_engine.steps import StepInputs


# -- commands (leader -> followers) ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SubmitCmd:
    req: PrefillRequest


@dataclass(frozen=True, slots=True)
class ScheduleCmd:
    request_id: str
    forward: int
    tokens_done: int
    last: bool
    src_pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefillDoneCmd:
    request_id: str


@dataclass(frozen=True, slots=True)
class AbortCmd:
    request_id: str


@dataclass(frozen=True, slots=True)
class ForgetCmd:
    request_id: str


@dataclass(frozen=True, slots=True)
class AbandonCmd:
    request_id: str


@dataclass(frozen=True, slots=True)
class ExpectCmd:
    request_id: str
    epoch: int
    prefill_agents: tuple[str, ...]
    num_pages: int
    seed: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class ConnectCmd:
    """Ranks of a group that came up later (a restarted group): every rank connects its own side."""

    endpoints: tuple[RankEndpoint, ...]


PrefillCommand = SubmitCmd | ScheduleCmd | PrefillDoneCmd | AbortCmd | ConnectCmd  # to prefill ranks
DecodeCommand = ExpectCmd | AbortCmd | ForgetCmd | AbandonCmd | ConnectCmd  # to decode ranks
Command = PrefillCommand | DecodeCommand
PREFILL_COMMANDS = (SubmitCmd, ScheduleCmd, PrefillDoneCmd, AbortCmd, ConnectCmd)
DECODE_COMMANDS = (ExpectCmd, AbortCmd, ForgetCmd, AbandonCmd, ConnectCmd)


@dataclass(slots=True)
class GroupTick:
    commands: list[Command]
    inputs: StepInputs | None


@dataclass(slots=True)
class RankReport:
    rank: int
    completed: list[PrefillOutcome] = field(default_factory=list)  # prefill ranks
    ready: list[str] = field(default_factory=list)  # decode ranks
    failed: list[tuple[str, str]] = field(default_factory=list)
    releasable: list[str] = field(default_factory=list)
    lifted: list[tuple[str, int]] = field(default_factory=list)
    epochs: dict[str, int] = field(default_factory=dict)  # decode ranks: the epoch of each id reported above

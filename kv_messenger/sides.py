"""The two messenger sides as their users see them (Protocols; no implementation here).

``PrefillMessenger``: what a prefill node's connector (``serving.kv_links.PrefillLink``) drives —
``submit`` -> ``schedule`` per step -> ``prefill_done`` -> (``set_metadata``) -> ``completed()``;
``abort`` any time. ``DecodeMessenger``: what a decode node's connector (``DecodeLink``) and request
path drive — ``expect`` -> ``poll()`` -> ``DecodePoll(ready, failed, releasable, lifted)``;
``abort`` / ``forget`` / ``abandon`` (failover: the epoch becomes a fence) any time.

A rank's own side (``PrefillSide``, ``DecodeSide``) implements them, and so does a TP group
leader's view of every rank (``serving.tp_group.GroupPrefillSide`` / ``GroupDecodeSide``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kv_messenger.decode_side import DecodePoll
    from kv_messenger.prefill_side import PrefillOutcome
    from kv_messenger.protocol import PrefillRequest, RankEndpoint


class PrefillMessenger(Protocol):
    def endpoint(self) -> RankEndpoint: ...

    def connect(self, decode_ranks: Sequence[RankEndpoint]) -> None: ...

    def submit(self, req: PrefillRequest) -> None: ...

    def schedule(
        self, request_id: str, forward: int, tokens_done: int, last: bool, src_pages: Sequence[int]
    ) -> None: ...

    def set_metadata(self, request_id: str, payload: torch.Tensor) -> None: ...

    def prefill_done(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def completed(self) -> list[PrefillOutcome]: ...


class DecodeMessenger(Protocol):
    @property
    def agents(self) -> list[str]: ...  # the decode group's ranks' agents, by TP rank

    @property
    def meta_slots(self) -> int: ...  # metadata slots (the prefill's last hidden state) for requests in transfer

    def endpoint(self) -> RankEndpoint: ...

    def connect(self, prefill_ranks: Sequence[RankEndpoint]) -> None: ...

    def expect(
        self,
        request_id: str,
        epoch: int,
        prefill_agents: Sequence[str],
        num_pages: int,
        seed: int,
        meta: bool,
        timeout_s: float,
    ) -> int: ...

    def meta_slot(self, slot: int) -> torch.Tensor: ...

    def abort(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def abandon(self, request_id: str) -> int | None: ...

    def poll(self) -> DecodePoll: ...

    def live(self) -> int: ...

"""Typed, versioned messages between prefill and decode sides.

Across processes (handshake, prefill requests) messages are pydantic models; the
notifications that ride on transfers are a compact ``kind|request|epoch|count`` byte string.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass
from urllib.parse import quote, unquote

import torch
from pydantic import BaseModel, ConfigDict, Field

from kv_messenger.layout import PROTOCOL_VERSION, KVLayoutSpec


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = PROTOCOL_VERSION


class RankEndpoint(_Msg):
    """What a peer needs to write into (or be written from) one rank: agent, pools, metadata buffer."""

    agent: str
    metadata_b64: str  # the transport's agent metadata
    layout: KVLayoutSpec
    layer_addrs: list[int]  # base address of each layer's pool
    num_pages: int
    meta_addr: int = 0  # decode leader: base of the metadata slots (the prefill's last hidden state, fp32)
    meta_slot_bytes: int = 0
    meta_slots: int = 0

    @classmethod
    def of(
        cls,
        agent: str,
        metadata: bytes,
        layout: KVLayoutSpec,
        pools: list[torch.Tensor],
        meta: torch.Tensor | None = None,
        meta_slots: int = 0,
    ) -> RankEndpoint:
        slot_bytes = meta.shape[1] if meta is not None and meta_slots else 0
        return cls(
            agent=agent,
            metadata_b64=base64.b64encode(metadata).decode(),
            layout=layout,
            layer_addrs=[p.data_ptr() for p in pools],
            num_pages=pools[0].shape[0],
            meta_addr=meta.data_ptr() if meta is not None and meta_slots else 0,
            meta_slot_bytes=slot_bytes,
            meta_slots=meta_slots,
        )

    @property
    def metadata(self) -> bytes:
        return base64.b64decode(self.metadata_b64)


class PrefillRequest(_Msg):
    """Decode -> prefill: prefill this prompt and write its KV into these pages."""

    request_id: str
    epoch: int = Field(ge=0)
    prompt_ids: list[int]
    dst_pages: list[int]  # the decode side's pages for tokens [first_page * page_size, n-1), in token order
    first_page: int = Field(default=0, ge=0)  # pages of the prompt's start the decoder holds (its prefix cache)
    decode_ranks: list[str]  # agent names of the decode group's ranks, by rank
    seed: int = 0  # picks source replicas in the shard plan; both sides compute the same plan
    meta_slot: int | None = None  # decode leader's metadata slot, or None for no metadata
    ttl_s: float = Field(default=60.0, gt=0)  # the job expires this long after it reaches the prefill node
    cache_salt: str | None = None  # the request's: the prefill node's prefix cache shares pages only within it


class NotifKind(enum.Enum):
    KV = "k"  # ``count`` page writes of one request landed
    META = "m"  # the metadata write landed (counts as one write)
    FIN = "f"  # the sender finished the request having posted ``count`` writes to this rank
    ABORTED = "a"  # the sender stopped the request; ``count`` writes were posted before it stopped
    REFUSED = "r"  # the prefill group refused the request before any rank started it: nobody writes


@dataclass(frozen=True, slots=True)
class Notification:
    kind: NotifKind
    request_id: str
    epoch: int
    count: int
    reason: str = ""  # REFUSED: why

    def encode(self) -> bytes:
        head = f"{self.kind.value}|{self.request_id}|{self.epoch}|{self.count}"
        if self.kind is NotifKind.REFUSED:
            head += "|" + quote(self.reason, safe="")
        return head.encode()

    @classmethod
    def decode(cls, raw: bytes) -> Notification:
        try:
            kind_s, rest = raw.decode().split("|", 1)
            kind = NotifKind(kind_s)
            if kind is NotifKind.REFUSED:
                rid, epoch, count, reason = rest.rsplit("|", 3)  # request ids may contain '|'
                return cls(kind, rid, int(epoch), int(count), unquote(reason))
            rid, epoch, count = rest.rsplit("|", 2)
            return cls(kind, rid, int(epoch), int(count))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed notification {raw!r}") from exc

"""What one rank's KV pool looks like, and which part of the model's KV it holds.

Both sides exchange their ``KVLayoutSpec`` at handshake. ``compat_hash`` covers everything
that must be identical for pages to be meaningful on the other side (model KV shape, page
size, page layout, dtype, protocol version); tensor-parallel sizes may differ, the shard plan
handles that. A mismatch is an ``IncompatibleLayoutError`` and nothing is transferred.
"""

from __future__ import annotations

import enum
import hashlib

from pydantic import BaseModel, ConfigDict, Field, model_validator

from torch_engine.config import DType, KVLayout

PROTOCOL_VERSION = 4  # 2: REFUSED notifications, PrefillRequest.ttl_s; 3: PrefillRequest.first_page;
# 4: PrefillRequest.cache_salt


class IncompatibleLayoutError(ValueError):
    """The two sides' pages do not mean the same thing; no byte may be moved between them."""


class AttentionKind(enum.Enum):
    GQA = "gqa"  # per-head K and V, heads sharded (or replicated) across TP ranks
    MLA = "mla"  # one compressed latent per token, identical on every TP rank


class KVLayoutSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: AttentionKind
    num_layers: int = Field(gt=0)
    page_size: int = Field(gt=0)
    layout: KVLayout
    dtype: DType
    kv_heads: int = Field(default=0, ge=0)  # GQA: the model's KV heads (all ranks together)
    head_dim: int = Field(default=0, ge=0)
    latent_dim: int = Field(default=0, ge=0)  # MLA: kv_lora_rank + rope dim
    tp_size: int = Field(default=1, ge=1)
    tp_rank: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> KVLayoutSpec:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}")
        if self.kind is AttentionKind.GQA:
            if self.kv_heads <= 0 or self.head_dim <= 0:
                raise ValueError("GQA layouts need kv_heads and head_dim")
            h, t = self.kv_heads, self.tp_size
            if (t <= h and h % t) or (t > h and t % h):
                raise ValueError(f"TP {t} and {h} KV heads: one must divide the other")
        elif self.latent_dim <= 0:
            raise ValueError("MLA layouts need latent_dim")
        return self

    # -- what this rank holds ------------------------------------------------------------
    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    def heads_of(self, rank: int) -> range:
        """KV heads that ``rank`` holds (one replicated head when TP > KV heads)."""
        h, t = self.kv_heads, self.tp_size
        if t <= h:
            per = h // t
            return range(rank * per, (rank + 1) * per)
        first = rank * h // t
        return range(first, first + 1)

    @property
    def local_heads(self) -> int:
        return len(self.heads_of(self.tp_rank)) if self.kind is AttentionKind.GQA else 1

    @property
    def head_bytes(self) -> int:
        """GQA: bytes of one head's K and V for one token (``2 * head_dim`` elements)."""
        return 2 * self.head_dim * self.element_size

    @property
    def page_bytes(self) -> int:
        if self.kind is AttentionKind.MLA:
            return self.page_size * self.latent_dim * self.element_size
        return self.page_size * self.local_heads * self.head_bytes

    def for_rank(self, rank: int) -> KVLayoutSpec:
        return self.model_copy(update={"tp_rank": rank})

    def compat_hash(self) -> str:
        key = (
            PROTOCOL_VERSION,
            self.kind.value,
            self.num_layers,
            self.page_size,
            self.layout.value,
            self.dtype.value,
            self.kv_heads,
            self.head_dim,
            self.latent_dim,
        )
        return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


def check_compatible(src: KVLayoutSpec, dst: KVLayoutSpec) -> None:
    if src.compat_hash() == dst.compat_hash():
        return
    fields = ("kind", "num_layers", "page_size", "layout", "dtype", "kv_heads", "head_dim", "latent_dim")

    def show(v: object) -> str:
        return str(v.value) if isinstance(v, enum.Enum) else str(v)

    diff = [
        f"{f}: {show(getattr(src, f))} vs {show(getattr(dst, f))}" for f in fields if getattr(src, f) != getattr(dst, f)
    ]
    raise IncompatibleLayoutError("KV layouts differ (prefill vs decode): " + "; ".join(diff))

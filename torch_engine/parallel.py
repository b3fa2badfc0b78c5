"""Tensor-parallel group: the rank, the size and the one collective the model needs."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TPGroup:
    """A tensor-parallel group over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

    ``TPGroup.single()`` is the TP=1 group: every collective is a no-op.
    """

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} outside 0..{size - 1}")
        if size > 1 and not dist.is_initialized():
            raise RuntimeError("TP > 1 needs torch.distributed initialised first")
        self.rank = rank
        self.size = size
        self.group = group
        self._gloo = size > 1 and dist.get_backend(group) == "gloo"

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self._gloo and x.dtype != torch.float32:
            y = x.float()
            dist.all_reduce(y, group=self.group)
            return y.to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast_object(self, obj: object) -> object:
        """Send ``obj`` from the leader to every rank; returns it on all ranks."""
        if self.size == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def gather_object(self, obj: object) -> list[object] | None:
        """Collect ``obj`` from every rank on the leader (in rank order); None on the other ranks."""
        if self.size == 1:
            return [obj]
        out: list[object] | None = [None] * self.size if self.is_leader else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather_object(obj, out, dst=dst, group=self.group)
        return out

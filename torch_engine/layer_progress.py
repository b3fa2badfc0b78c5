"""Per-layer completion counter: the model bumps it, another thread polls it.

Right after each layer's attention output projection (the layer's KV append is done by then)
the model adds 1 to ``counts[layer]``. A poller (the KV messenger's thread) reads the counts
without locks: ``counts[layer] == n`` means the ``n``-th forward pass since start-up has written
that layer's KV. The model never calls back into Python for this, so the scheme survives CUDA
graph capture: on CUDA the bump is a device add followed by an asynchronous copy into pinned
host memory, both recorded on the stream in order.
"""

from __future__ import annotations

import torch


class LayerProgress:
    def __init__(self, num_layers: int, device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._dev = torch.zeros(num_layers, dtype=torch.int64, device=self.device)
            self._host = torch.zeros(num_layers, dtype=torch.int64).pin_memory()
        else:
            self._dev = torch.zeros(num_layers, dtype=torch.int64)
            self._host = self._dev
        self._view = self._host.numpy()

    def bump(self, layer: int) -> None:
        """Called by the model after ``layer``'s output projection."""
        if self._dev is self._host:
            self._view[layer] += 1  # CPU: the forward pass runs on this thread, in order
        else:
            self._dev[layer] += 1
            self._host[layer].copy_(self._dev[layer], non_blocking=True)

    def cpu_counts(self) -> torch.Tensor:
        """The counts themselves (CPU only), for compiled code that bumps them in place (``fused_step.py``)."""
        if self._dev is not self._host:
            raise ValueError("the counts of a CUDA counter live on the device")
        return self._dev

    def completed(self, layer: int) -> int:
        """How many forward passes have finished ``layer`` (safe to call from any thread)."""
        return int(self._view[layer])

    def snapshot(self) -> list[int]:
        """All counts, read last layer first: since counts only grow and layer i never runs behind
        layer i+1, reading in this order yields a consistent view (``counts[i] >= counts[i + 1]``)."""
        counts = [int(self._view[i]) for i in reversed(range(self.num_layers))]
        return counts[::-1]

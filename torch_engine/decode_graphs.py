"""Decode-only steps through static buffers, replayed from CUDA graphs on a GPU.

A decode node's steady state is a batch of single-token rows. Each such step is padded to a
*bucket* (batch ``B`` rounded up to a power of two, page-table width ``M`` rounded up to a power
of two), its inputs are copied into that bucket's static buffers, and the bucket's captured graph
is replayed: one launch instead of ~50 kernels per layer. Padded rows write their KV into a
scratch page (one page past the allocator's pool) and attend to it alone, so they touch no
request's pages. Real rows' page tables are padded with their own first page; the mask (built
inside the graph from the KV lengths) hides the padding.

The per-layer counter survives replay: the model bumps ``LayerProgress`` with a device add and
an asynchronous copy to pinned host memory, both recorded in the graph, so every replay moves
the counter exactly as an eager step does. Warm-up before capture runs against a private counter
and the scratch page, so capturing changes neither the counter nor any page.

On a CPU nothing is captured: ``run`` executes the same function eagerly on the bucket's
buffers (tests use that to check the padding and bucketing on any machine). Eligible steps:
decode-only, TP 1 (a TP group's all-reduce would need NCCL inside the graph: not done), models
without MoE routing (data-dependent shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_engine.attention import AttentionMetadata
from torch_engine.kv_cache import PagedKVCache
from torch_engine.layer_progress import LayerProgress
from torch_engine.layers import RotaryTable
from torch_engine.models.decoder import CausalLM


def bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(slots=True)
class _Bucket:
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_pages: torch.Tensor  # [B]
    slot_offsets: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, M]
    kv_lens: torch.Tensor  # [B]
    out: torch.Tensor | None = None  # [B, hidden] after a run / capture
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        progress: LayerProgress,
        rope: RotaryTable,
        device: torch.device,
        scratch_page: int,
        max_batch: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv = kv
        self.progress = progress
        self.rope = rope
        self.device = device
        self.page_size = kv.spec.page_size
        self.dtype = kv.compute_dtype
        self.scratch = scratch_page
        self.max_batch = bucket(max_batch)
        self.capture = capture and device.type == "cuda"
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0  # steps served from a bucket (tests, metrics)

    def eligible(self, num_rows: int, has_prefills: bool) -> bool:
        return not has_prefills and 0 < num_rows <= self.max_batch

    @property
    def captured(self) -> int:
        return sum(b.graph is not None for b in self._buckets.values())

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, kv_lens: torch.Tensor
    ) -> torch.Tensor:
        """Final-norm hidden states ``[B, hidden]`` of a decode-only step (CPU inputs, any B <= max)."""
        b, m = tables.shape
        key = (bucket(b), bucket(m))
        slot = self._buckets.get(key)
        if slot is None:
            slot = self._buckets[key] = self._make(*key)
        self._fill(slot, input_ids, positions, tables, kv_lens)
        if slot.graph is not None:
            slot.graph.replay()
        else:
            slot.out = self._forward(slot, self.progress)
        self.replays += 1
        assert slot.out is not None
        return slot.out[:b]

    # -- internals -----------------------------------------------------------------------
    def _make(self, b: int, m: int) -> _Bucket:
        d = self.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=d)

        slot = _Bucket(zeros(b), zeros(b), zeros(b), zeros(b), zeros(b, m), zeros(b))
        self._pad(slot, 0)
        if self.capture:
            self._capture(slot)
        return slot

    def _pad(self, slot: _Bucket, start: int) -> None:
        """Rows from ``start`` on: write to the scratch page, attend to its first token only."""
        slot.input_ids[start:] = 0
        slot.positions[start:] = 0
        slot.slot_pages[start:] = self.scratch
        slot.slot_offsets[start:] = 0
        slot.page_table[start:] = self.scratch
        slot.kv_lens[start:] = 1

    def _fill(
        self, slot: _Bucket, ids: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> None:
        b, m = tables.shape
        p = self.page_size
        slot.input_ids[:b].copy_(ids, non_blocking=True)
        slot.positions[:b].copy_(pos, non_blocking=True)
        slot.slot_pages[:b].copy_(tables.gather(1, (pos // p).unsqueeze(1)).squeeze(1), non_blocking=True)
        slot.slot_offsets[:b].copy_(pos % p, non_blocking=True)
        width = slot.page_table.shape[1]
        padded = torch.cat((tables, tables[:, :1].expand(b, width - m)), dim=1) if width > m else tables
        slot.page_table[:b].copy_(padded, non_blocking=True)
        slot.kv_lens[:b].copy_(lens, non_blocking=True)
        self._pad(slot, b)

    def _forward(self, slot: _Bucket, progress: LayerProgress) -> torch.Tensor:
        """The captured function: everything from the static buffers, nothing from Python state."""
        cos, sin = self.rope.lookup(slot.positions)
        width = slot.page_table.shape[1] * self.page_size
        keys = torch.arange(width, device=self.device)[None, :]
        meta = AttentionMetadata(
            slot.slot_pages,
            slot.slot_offsets,
            cos.to(self.dtype),
            sin.to(self.dtype),
            decode_rows=torch.arange(slot.input_ids.shape[0], device=self.device),
            decode_page_table=slot.page_table,
            decode_mask=(keys < slot.kv_lens[:, None])[:, None, None, :],
            decode_kv_lens=slot.kv_lens,
        )
        return self.model.norm(self.model(slot.input_ids, meta, self.kv, progress))

    def _capture(self, slot: _Bucket) -> None:
        """Warm up on a side stream against a private counter (the buffers are all padding, so only
        the scratch page is written), then capture with the real counter."""
        warm = LayerProgress(self.progress.num_layers, self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(slot, warm)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            slot.out = self._forward(slot, self.progress)
        slot.graph = graph

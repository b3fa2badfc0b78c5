"""Turns a scheduled step into tensors, runs the model on every TP rank, returns the rows to sample.

The leader builds ``StepInputs`` (small, picklable) and broadcasts it; every rank runs
``execute``; TP followers sit in ``follower_loop`` until the leader broadcasts ``None``.
A ``TickHook`` (the messenger's TP-group channel) may wrap what the leader broadcasts, so that
one collective per step carries both the step and the messenger commands for the followers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from torch_engine.attention import AttentionMetadata, PrefillSegment, context_mask
from torch_engine.decode_graphs import DecodeGraphs
from torch_engine.fused_step import FusedStep, why_not_fused
from torch_engine.kernels import cpu_kernels
from torch_engine.kv_cache import PagedKVCache
from torch_engine.layer_progress import LayerProgress
from torch_engine.layers import RotaryTable
from torch_engine.models.decoder import CausalLM
from torch_engine.parallel import TPGroup
from torch_engine.scheduler import SchedulerOutput
from torch_engine.steps import DraftInputs, Span, StepInputs

if TYPE_CHECKING:
    from torch_engine.connector import TickHook


def _page_table(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        progress: LayerProgress,
        tp: TPGroup,
        device: torch.device,
        max_positions: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.progress = progress
        self.tp = tp
        self.device = device
        self.page_size = kv.spec.page_size
        self.dtype = kv.compute_dtype
        cfg = model.cfg
        self.rope = RotaryTable(model.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device)
        self.tick_hook: TickHook | None = None
        self.graphs: DecodeGraphs | None = None  # decode-only steps through static buffers / CUDA graphs
        self.fused: FusedStep | None = None  # decode-only steps in one compiled call (CPU)
        self._hidden = torch.empty(0)  # the last step's final hidden states, every row (MTP models)
        self._uncounted = LayerProgress(progress.num_layers, device)  # passes outside the layer counter

    def use_decode_graphs(self, scratch_page: int, max_batch: int) -> None:
        """Serve decode-only steps from ``DecodeGraphs`` (captured on CUDA, eager buffers elsewhere)."""
        capture = self.device.type == "cuda"
        self.graphs = DecodeGraphs(
            self.model, self.kv, self.progress, self.rope, self.device, scratch_page, max_batch, capture
        )

    def use_fused_step(self, wanted: bool | None) -> None:
        """Serve decode-only steps from ``FusedStep``: None where this model can, True required (raises
        why not), False never."""
        if wanted is False:
            return
        kernels = cpu_kernels()
        reason = why_not_fused(self.model, self.kv, self.tp, self.device) if kernels else "no compiled CPU kernels"
        if reason is None and kernels is not None:
            self.fused = FusedStep(self.model, self.kv, self.progress, self.rope, kernels)
        elif wanted:
            raise ValueError(f"fused_decode is on, but this engine cannot run its decode steps fused: {reason}")

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        spans = []
        for c in sched.chunks:
            req = c.request
            tokens = req.all_tokens + list(c.draft) if c.draft else req.all_tokens
            spans.append(Span(tokens[c.start : c.start + c.length], c.start, req.pages, c.outputs))
        inputs = self.layout(spans)
        inputs.page_copies = sched.copies
        return inputs

    def layout(self, spans: list[Span]) -> StepInputs:
        """The step's tensors for ``spans`` (rows in span order)."""
        ids: list[int] = []
        pos: list[int] = []
        pages: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, torch.Tensor]] = []
        out_rows: list[int] = []
        p = self.page_size
        for sp in spans:
            row, n = len(ids), len(sp.ids)
            ids += sp.ids
            pos += range(sp.start, sp.start + n)
            pages += [sp.pages[i // p] for i in range(sp.start, sp.start + n)]
            used = sp.pages[: -(-(sp.start + n) // p)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(used)
                decode_lens.append(sp.start + 1)
            else:
                prefills.append((row, row + n, sp.start, _page_table([used])))
            out_rows += range(row + n - sp.outputs, row + n)
        positions = torch.tensor(pos, dtype=torch.long)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=positions,
            slot_pages=torch.tensor(pages, dtype=torch.long),
            slot_offsets=positions % p,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long) if decode_rows else None,
            decode_tables=_page_table(decode_tables) if decode_tables else None,
            decode_kv_lens=torch.tensor(decode_lens, dtype=torch.long) if decode_lens else None,
            prefills=prefills,
            output_rows=torch.tensor(out_rows, dtype=torch.long),
        )

    def _metadata(self, s: StepInputs) -> AttentionMetadata:
        d = self.device
        cos, sin = self.rope.lookup(s.positions.to(d))
        meta = AttentionMetadata(s.slot_pages.to(d), s.slot_offsets.to(d), cos.to(self.dtype), sin.to(self.dtype))
        if s.decode_rows is not None and s.decode_tables is not None and s.decode_kv_lens is not None:
            width = s.decode_tables.shape[1] * self.page_size
            keys = torch.arange(width)[None, :]
            meta.decode_rows = s.decode_rows.to(d)
            meta.decode_page_table = s.decode_tables.to(d)
            meta.decode_mask = (keys < s.decode_kv_lens[:, None])[:, None, None, :].to(d)
            meta.decode_kv_lens = s.decode_kv_lens.to(d)
        for start, end, first, table in s.prefills:
            width = table.shape[1] * self.page_size
            mask = context_mask(first, end - start, first + end - start, width, torch.device("cpu")).to(d)
            meta.prefills.append(PrefillSegment(start, end, table.to(d), mask, first))
        return meta

    @torch.inference_mode()
    def execute(self, s: StepInputs) -> torch.Tensor:
        """Runs the step on this rank (its page copies first); returns the final-norm hidden states of
        ``output_rows``."""
        if s.page_copies:
            self.kv.copy_pages(s.page_copies)
        g, tables, lens = self.graphs, s.decode_tables, s.decode_kv_lens
        rows = s.output_rows.to(self.device)
        f = self.fused
        if s.prefills:
            f = g = None
        if f is not None and tables is not None and lens is not None and s.decode_only and f.takes(len(s.input_ids)):
            hidden = f.run(s.input_ids, s.positions, tables, lens)
        elif g is not None and tables is not None and lens is not None and g.eligible(len(s.input_ids), False):
            hidden = g.run(s.input_ids, s.positions, tables, lens)
        else:
            h = self.model(s.input_ids.to(self.device), self._metadata(s), self.kv, self.progress)
            if self.model.mtp is None:
                return self.model.norm(h[rows])
            hidden = self.model.norm(h)
        if self.model.mtp is not None:
            self._hidden = hidden  # every row: the MTP pass reads them
        return hidden[rows]

    @torch.inference_mode()
    def execute_draft(self, d: DraftInputs) -> torch.Tensor:
        """Runs the MTP pass on this rank; returns the MTP module's normed output at the output rows."""
        mtp = self.model.mtp
        assert mtp is not None, "a draft pass needs a model with an MTP module"
        s = d.step
        if not len(s.input_ids):
            self.progress.bump(mtp.layer)
            return torch.empty(0, self.model.cfg.hidden_size, device=self.device, dtype=self.dtype)
        given = d.hidden
        hidden = given.to(self.device, self.dtype) if given is not None else self._hidden[d.hidden_rows.to(self.device)]
        progress = self.progress if d.counted else self._uncounted
        out = mtp(self.model.embed(s.input_ids.to(self.device)), hidden, self._metadata(s), self.kv, progress)
        return out[s.output_rows.to(self.device)]

    def run_draft(self, d: DraftInputs) -> torch.Tensor:
        """Leader: broadcast the MTP pass to the followers and run it."""
        self.tp.broadcast_object(d)
        return self.execute_draft(d)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head
        if head.quant is not None:  # the integer kernel takes fp32 rows and answers in fp32: no bf16 round trip
            return head(hidden.float())
        return head(hidden).float()

    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """Leader: broadcast the step to the followers, run it, return the output rows' hidden states."""
        inputs = self.prepare(sched)
        hook = self.tick_hook
        self.tp.broadcast_object(inputs if hook is None else hook.wrap(inputs))
        hidden = self.execute(inputs)
        if hook is not None:
            hook.after()
        return hidden

    def stop_followers(self) -> None:
        self.tp.broadcast_object(None)

    def follower_loop(self, on_message: Callable[[object], None] | None = None) -> None:
        """TP ranks other than the leader: run every step the leader broadcasts, until ``None``.
        Anything else the leader broadcasts (a wrapped step) goes to ``on_message``."""
        while True:
            msg = self.tp.broadcast_object(None)
            if msg is None:
                return
            if isinstance(msg, StepInputs):
                self.execute(msg)
            elif isinstance(msg, DraftInputs):
                self.execute_draft(msg)
            elif on_message is not None:
                on_message(msg)
            else:
                raise RuntimeError(f"TP follower got {type(msg).__name__} and has no handler for it")

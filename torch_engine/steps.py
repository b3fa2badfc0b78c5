"""What one step sends to every TP rank (a leaf: torch only).

``StepInputs`` is a step's main pass, ``DraftInputs`` its multi-token-prediction pass; both are
small and picklable, so the leader broadcasts them (wrapped by a ``TickHook`` when the messenger's
commands ride along) and followers run them. ``Span`` is one request's positions in a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_pages: torch.Tensor  # [T]
    slot_offsets: torch.Tensor  # [T]
    decode_rows: torch.Tensor | None  # [B]
    decode_tables: torch.Tensor | None  # [B, M]
    decode_kv_lens: torch.Tensor | None  # [B]
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (row start, row end, first position, page table [1, M])
    output_rows: torch.Tensor  # [S] rows whose final hidden state / logits are wanted
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination), before the pass

    @property
    def decode_only(self) -> bool:
        """Every row is one decode token (rows in order: ``decode_rows`` is 0..B-1)."""
        rows = self.decode_rows
        return not self.prefills and rows is not None and len(rows) == len(self.input_ids)


@dataclass(slots=True)
class Span:
    """Consecutive positions of one request computed in a pass."""

    ids: list[int]  # the input token of each position
    start: int  # position of the first
    pages: list[int]  # the request's pages
    outputs: int  # how many of the last rows are output rows


@dataclass(slots=True)
class DraftInputs:
    """The multi-token-prediction pass of a step (``models.decoder.MTPModule``), run on every rank
    after the step's tokens are chosen: ``step.input_ids`` are the next tokens, fed with the main
    pass's final hidden states of rows ``hidden_rows`` (or with ``hidden``, shipped from a prefill
    node); ``step.output_rows`` are the rows whose draft is wanted. Empty (no rows): every rank
    still marks the MTP layer done for this forward pass (the layer counters stay in step)."""

    step: StepInputs
    hidden_rows: torch.Tensor  # [T] rows of the main pass
    hidden: torch.Tensor | None = None  # [T, H] instead of the main pass's rows
    counted: bool = True  # a forward pass of the layer counter (False: a split request's first draft)

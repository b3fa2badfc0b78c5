"""TP > 1 (separate processes over gloo) produces the same tokens as TP = 1."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from tests.helpers import prompt_of, tiny_engine, tp_generate
from torch_engine.sampling import SamplingParams

PROMPTS = [prompt_of(23, 1), prompt_of(7, 2), prompt_of(41, 3)]


@pytest.mark.parametrize(
    ("kind", "tp"),
    [
        ("llama", 2),  # 8 q heads, 4 KV heads: 2 KV heads per rank
        ("deepseek_v3", 2),  # MLA: latent replicated, heads and experts split
        ("qwen2", 4),  # 2 KV heads over 4 ranks: each KV head replicated on 2 ranks
    ],
)
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_tp_equals_tp1(kind: str, tp: int, fast: bool, tiny_engine_dir, tmp_path) -> None:
    ref = tiny_engine(tiny_engine_dir(kind)).generate(PROMPTS, SamplingParams(max_tokens=8))
    out = tmp_path / "out.json"
    engine_dir = str(tiny_engine_dir(kind, tp=tp))
    args = (tp, str(tmp_path / "rdzv"), engine_dir, PROMPTS, 8, str(out), fast)
    mp.spawn(tp_generate, args=args, nprocs=tp, join=True)
    result = json.loads(out.read_text())
    assert result["tokens"] == ref
    assert result["pages_used"] == 0


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_tp_with_mtp_drafts_equals_tp1(kind: str, mtp_engine_dir, tmp_path) -> None:
    """The MTP pass runs on every rank (its block is sharded like a decoder layer; the leader
    broadcasts it after choosing the step's tokens): TP 2 with MTP drafts == TP 1 without."""
    ref = tiny_engine(mtp_engine_dir(kind)).generate(PROMPTS, SamplingParams(max_tokens=12))
    out = tmp_path / "out.json"
    args = (2, str(tmp_path / "rdzv"), str(mtp_engine_dir(kind, tp=2)), PROMPTS, 12, str(out), False, "mtp")
    mp.spawn(tp_generate, args=args, nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["tokens"] == ref
    assert result["drafts"] > 0 and result["pages_used"] == 0

"""TP > 1 (separate processes over gloo) produces the same tokens as TP = 1."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from tests.helpers import tiny_engine, tp_generate
from tests.test_engine_equivalence import prompt_of
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

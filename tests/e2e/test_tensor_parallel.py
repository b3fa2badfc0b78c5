"""TP > 1 (separate processes over gloo) produces the same tokens as TP = 1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import TINY_CONFIGS, build_tiny, generate_staggered, prompt_of, tiny_engine, tp_generate
from torch_engine.guided import Guide, GuideKind
from torch_engine.sampling import SamplingParams
from torch_engine.tokenizer import Tokenizer

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


def test_tp2_copies_a_shared_partial_page_on_every_rank(tiny_engine_dir, tmp_path) -> None:
    """``n`` > 1's other choices copy the prompt's partial last page from the first choice's (the leader
    decides, every rank copies its shard before the step): TP 2 gives TP 1's tokens, each other choice
    reusing all of its prompt but the last token (7 tokens: 1 full page and 2 copied; 103: 25 and 2)."""
    prompts = [prompt_of(7, 11)] * 3 + [prompt_of(103, 12)] * 2
    want = generate_staggered(tiny_engine(tiny_engine_dir("llama")), prompts, [SamplingParams(max_tokens=8)] * 5)
    out = tmp_path / "out.json"
    two = str(tiny_engine_dir("llama", tp=2))
    args = (2, str(tmp_path / "rdzv"), two, prompts, 8, str(out), False, None, None, True)  # staggered
    mp.spawn(tp_generate, args=args, nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["tokens"] == [list(o.output_ids) for o in want]
    assert result["cached"] == [0, 6, 6, 0, 102] and result["pages_used"] == 0


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


def test_constrained_decoding_on_tp2_equals_tp1(smollm2_dir: Path, tmp_path: Path) -> None:
    """The TP leader alone samples, so only it holds the grammar: a tiny random llama with SmolLM2's
    tokenizer (49,152 tokens), TP 2 gives TP 1's constrained tokens, each output following the regex."""
    cfg = TINY_CONFIGS["llama"]()
    cfg.vocab_size = 49152
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    folder = tmp_path / "ckpt"
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True).save_pretrained(str(folder))
    one, two = build_tiny(folder, tmp_path / "tp1"), build_tiny(folder, tmp_path / "tp2", tp=2)
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"  # ASCII digits: a random model likes other scripts' (\d allows them)
    prompts = [prompt_of(23, 1), prompt_of(7, 2)]
    ref = tiny_engine(one, tokenizer=True).generate(
        prompts, SamplingParams(max_tokens=24, guide=Guide(GuideKind.REGEX, phone))
    )
    out = tmp_path / "out.json"
    args = (2, str(tmp_path / "rdzv"), str(two), prompts, 24, str(out), False, None, ("regex", phone))
    mp.spawn(tp_generate, args=args, nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["tokens"] == ref and result["pages_used"] == 0
    tok = Tokenizer(one)
    assert all(re.fullmatch(phone, tok.decode(t)) for t in ref), [tok.decode(t) for t in ref]

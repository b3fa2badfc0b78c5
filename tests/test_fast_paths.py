"""The serving fast paths against the reference path on the embedded model (3 prompts x 32 greedy tokens),
built dense (the GGUF's weights dequantised at build time; ``tests/test_quant.py`` covers them as stored).

- fp32 with packed oneDNN weights and the fused paged decode attention (``fast_cpu``): the same
  greedy tokens as the reference path.
- ``dtype: auto`` (bf16 on CPUs with native bf16 dot products, else packed fp32): teacher-forced on
  the reference's tokens, at every step the reference token is the fast path's top-1, or ties with
  it within one bf16 step at the logits' magnitude (0.125: bf16 keeps 8 significant bits, logits
  here are 16-32). Exact ties do occur in bf16 (two were seen in these 96 steps); argmax takes the
  lower id then, so "same top-1" alone would fail on rounding, not on a wrong model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import smollm2_prompts
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
TIE = 0.125


@pytest.fixture(scope="module")
def reference(smollm2_dense_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dense_dir, num_pages=128))
    tok = engine.tokenizer
    assert tok is not None
    prompts = smollm2_prompts(tok)
    return prompts, engine.generate(prompts, GREEDY)


def test_packed_fp32_with_fused_attention_equals_reference(smollm2_dense_dir: Path, reference) -> None:
    prompts, want = reference
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dense_dir, num_pages=128, fast_cpu=True))
    assert "onednn-packed/fused-attention" in engine.kernel_path
    assert engine.generate(prompts, GREEDY) == want


def test_auto_dtype_top1_on_every_step(smollm2_dense_dir: Path, reference) -> None:
    prompts, want = reference
    engine = LLMEngine(EngineConfig(engine_dir=smollm2_dense_dir, num_pages=512, dtype="auto"))
    gaps: list[float] = []
    for prompt, tokens in zip(prompts, want, strict=True):
        ids = [
            engine.add_request(prompt + tokens[:k], SamplingParams(max_tokens=1), want_last_hidden=True)
            for k in range(len(tokens))
        ]
        while engine.has_unfinished():
            engine.step()
        for k, rid in enumerate(ids):
            logits = engine.request(rid).last_logits
            assert logits is not None
            gaps.append(float(logits.max() - logits[tokens[k]]))
            engine.retire(rid)
    assert len(gaps) == 96
    assert max(gaps) <= TIE, f"the reference token fell {max(gaps):.3f} below the top-1 ({engine.kernel_path})"
    assert engine.page_stats().used == 0
    if engine.describe().dtype == torch.bfloat16:  # a CPU with native bf16: the path really changed
        assert "onednn-packed/fused-attention" in engine.kernel_path and "bfloat16" in engine.kernel_path

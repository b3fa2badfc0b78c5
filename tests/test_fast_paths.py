"""The serving fast paths against the reference path on the embedded model (3 prompts x 32 greedy tokens),
built dense (the GGUF's weights dequantised at build time; ``tests/test_quant.py`` covers them as stored).

- fp32 with packed oneDNN weights and the fused paged decode attention (``fast_cpu``): the same
  greedy tokens as the reference path.
- ``dtype: auto`` (bf16 on CPUs with native bf16 dot products, else packed fp32): teacher-forced on
  the reference's tokens, at every step the reference token is the fast path's top-1, or ties with
  it within one bf16 step at the logits' magnitude (0.125: bf16 keeps 8 significant bits, logits
  here are 16-32). Exact ties do occur in bf16 (two were seen in these 96 steps); argmax takes the
  lower id then, so "same top-1" alone would fail on rounding, not on a wrong model. An fp32 CPU's ``auto`` keeps
  bf16 KV pages (``models.run_kv_dtype``), held to the same bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import smollm2_prompts
from torch_engine.config import DType, EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.kernels import cpu_kernels
from torch_engine.models import run_kv_dtype
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
    elif cpu_kernels() is not None:  # an fp32 CPU's auto, on the compiled kernels: bf16 pages (run_kv_dtype)
        assert engine.describe().kv_dtype == torch.bfloat16


def test_kv_pages_dtype_of_each_config(tmp_path: Path) -> None:
    """The pages' dtype: the config's wherever given; the compute dtype, except under ``auto`` on a CPU computing
    fp32 with the compiled kernels (bf16 pages there, which those kernels read in place); a GPU's never changed."""
    cpu, gpu, f32, bf16 = torch.device("cpu"), torch.device("cuda"), torch.float32, torch.bfloat16
    auto = EngineConfig(engine_dir=tmp_path, dtype="auto")
    assert run_kv_dtype(EngineConfig(engine_dir=tmp_path, dtype="auto", kv_dtype=DType.FLOAT32), f32, cpu) == f32
    assert run_kv_dtype(EngineConfig(engine_dir=tmp_path, dtype=DType.FLOAT32), f32, cpu) == f32
    assert run_kv_dtype(EngineConfig(engine_dir=tmp_path, kv_dtype=DType.BFLOAT16), f32, cpu) == bf16
    assert run_kv_dtype(auto, bf16, cpu) == bf16
    assert run_kv_dtype(auto, f32, gpu) == f32
    assert run_kv_dtype(auto, f32, cpu) == (bf16 if cpu_kernels() is not None else f32)

"""The embedded SmolLM2: engine greedy tokens equal HF transformers greedy tokens (fp32, same weights)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_greedy, smollm2_prompts
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import FinishReason
from torch_engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=128))


def test_greedy_equals_hf(engine: LLMEngine, hf_smollm2: torch.nn.Module) -> None:
    tok = engine.tokenizer
    assert tok is not None
    prompts = smollm2_prompts(tok)
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, got in zip(prompts, ours, strict=True):
        assert len(got) == 32
        assert got == hf_greedy(hf_smollm2, prompt, 32)[0]
    assert engine.page_stats().used == 0


def test_chat_template_and_stop_string(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    assert tok is not None
    ids = tok.encode("hi", chat=True)
    assert tok.decode(ids).startswith("system") or "<|im_start|>" in tok.hf.decode(ids)
    full = engine.generate(["The capital of France is"], SamplingParams(max_tokens=20))[0]
    text = tok.decode(full)
    stop = text.strip().split()[1]  # the second word of the greedy answer
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=20, stop=(stop,)))
    while engine.has_unfinished():
        engine.step()
    req = engine.request(rid)
    assert req.finish_reason is FinishReason.STOP
    assert stop not in req.text and text.startswith(req.text)
    assert len(req.output_ids) < len(full)


def test_cli_generate_streams(smollm2_dir: Path) -> None:
    cmd = [sys.executable, "-m", "disagg.cli", "generate", "--engine", str(smollm2_dir)]
    cmd += ["--prompt", "The capital of France is", "--max-tokens", "8", "--threads", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "TTFT" in done.stderr


def test_cli_rejects_bad_input(smollm2_dir: Path) -> None:
    cmd = [sys.executable, "-m", "disagg.cli", "generate", "--engine", str(smollm2_dir)]
    cmd += ["--prompt", "hi", "--top-p", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert "top_p must be in (0, 1]" in done.stderr

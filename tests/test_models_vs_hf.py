"""Engine logits against HF transformers (fp32, same weights): prefill, then 10 decode steps, on every
engine path (the fast CPU path too: packed oneDNN weights, fused attention and RMSNorm kernels)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import build_tiny, make_tiny_checkpoint, tiny_engine
from torch_engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("engine_path")  # reference, fast (packed, fused kernels) and decode-graph paths

PROMPT = [5, 17, 99, 3, 42, 7, 200, 11, 13, 77, 1, 250, 64]


def step_logits(engine, prompt: list[int], n: int) -> tuple[list[torch.Tensor], list[int]]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n), want_last_hidden=True)
    req = engine.request(rid)
    logits = []
    while not req.finished:
        engine.step()
        logits.append(req.last_logits)
    return logits, list(req.output_ids)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_logits_match_hf(kind: str, page_size: int, tiny, tiny_engine_dir) -> None:
    _, hf = tiny(kind)
    engine = tiny_engine(tiny_engine_dir(kind), page_size=page_size)
    logits, out = step_logits(engine, PROMPT, 11)  # 1 prefill + 10 decode steps
    assert len(logits) == 11
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + out])).logits[0]
    n = len(PROMPT)
    for j, got in enumerate(logits):
        torch.testing.assert_close(got, ref[n - 1 + j], atol=1e-4, rtol=1e-4, msg=f"{kind} step {j}")
    assert out == ref[n - 1 : n - 1 + len(out)].argmax(-1).tolist()


def test_drawn_biases_match_hf(tmp_path) -> None:
    """Qwen2's q / k / v biases drawn (HF's initialisation zeroes them, so the test above cannot see a
    bias dropped or misplaced): the engine's logits still equal HF's on every path."""
    folder, hf = make_tiny_checkpoint("qwen2", tmp_path / "ckpt", random_biases=True)
    assert any(float(p.detach().abs().max()) > 0 for n, p in hf.named_parameters() if n.endswith(".bias"))
    engine = tiny_engine(build_tiny(folder, tmp_path / "engine"))
    logits, out = step_logits(engine, PROMPT, 6)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + out])).logits[0]
    for j, got in enumerate(logits):
        torch.testing.assert_close(got, ref[len(PROMPT) - 1 + j], atol=1e-4, rtol=1e-4, msg=f"step {j}")

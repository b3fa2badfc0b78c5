"""The engine's own invariants: chunking, batching, KV layout and page size never change the tokens."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import prompt_of, tiny_engine
from torch_engine.config import KVLayout
from torch_engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("engine_path")  # reference, fast (packed) and decode-graph paths

GREEDY = SamplingParams(max_tokens=12)


def run_with_logits(engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], torch.Tensor]:
    rid = engine.add_request(prompt, params, want_last_hidden=True)
    req = engine.request(rid)
    logits = []
    while not req.finished:
        if any(out.request_id == rid for out in engine.step()):
            logits.append(req.last_logits)
    return list(req.output_ids), torch.stack(logits)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(kind: str, chunk: int, tiny_engine_dir) -> None:
    prompt = prompt_of(100, 1)
    ref_tokens, ref_logits = run_with_logits(tiny_engine(tiny_engine_dir(kind)), prompt)
    engine = tiny_engine(tiny_engine_dir(kind), chunk=chunk, budget=max(chunk, 8))
    tokens, logits = run_with_logits(engine, prompt)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_batch_of_8_equals_each_alone(kind: str, tiny_engine_dir) -> None:
    prompts = [prompt_of(5 + 9 * i, 10 + i) for i in range(8)]
    params = [SamplingParams(max_tokens=6 + i) for i in range(8)]
    pairs = list(zip(prompts, params, strict=True))
    alone = [run_with_logits(tiny_engine(tiny_engine_dir(kind)), p, sp)[0] for p, sp in pairs]
    engine = tiny_engine(tiny_engine_dir(kind), chunk=16, budget=48)  # mixed prefill + decode steps
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    mixed_steps = 0
    while engine.has_unfinished():
        sched_before = engine.queue_depths()[1]
        engine.step()
        mixed_steps += sched_before > 1
    assert mixed_steps > 0
    assert [engine.request(i).output_ids for i in ids] == alone
    assert engine.page_stats().used == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_hnd_equals_nhd(page_size: int, tiny_engine_dir) -> None:
    prompt = prompt_of(40, 3)
    hnd = tiny_engine(tiny_engine_dir("llama"), layout=KVLayout.HND, page_size=page_size)
    nhd = tiny_engine(tiny_engine_dir("llama"), layout=KVLayout.NHD, page_size=page_size)
    t1, l1 = run_with_logits(hnd, prompt)
    t2, l2 = run_with_logits(nhd, prompt)
    assert t1 == t2
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    # the same KV, laid out differently: HND pages are [head, k/v, token, dim], NHD [token, head, k/v, dim]
    assert hnd.kv_export().pools[0].shape[1:] == (4, 2, page_size, 8)
    assert nhd.kv_export().pools[0].shape[1:] == (page_size, 4, 2, 8)


def test_sampling_is_seeded_per_request(tiny_engine_dir) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    prompt = prompt_of(12, 5)
    a = tiny_engine(tiny_engine_dir("llama")).generate([prompt], params)[0]
    engine = tiny_engine(tiny_engine_dir("llama"))
    b = engine.generate([prompt, prompt_of(30, 6), prompt], params)  # batched with others
    assert b[0] == a and b[2] == a
    other = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=99))[0]
    assert other != a


def test_stop_token_ids_and_max_tokens(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"))
    prompt = prompt_of(10, 8)
    full = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert len(full) == 12
    stop_at = full[4]
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert cut == full[: full.index(stop_at) + 1]

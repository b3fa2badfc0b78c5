"""The two halves of a split request: prefill-only on one engine, decode-from-pages on another."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import copy_pages, prompt_of, reserve, tiny_engine
from torch_engine.config import EngineConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import RequestKind, RequestState
from torch_engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("engine_path")  # reference, fast (packed) and decode-graph paths


def split_generate(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    pid = prefill.add_request(prompt, kind=RequestKind.PREFILL_ONLY, want_last_hidden=True)
    while prefill.request(pid).state is not RequestState.PREFILLED:
        prefill.step()
    result = prefill.prefill_result(pid)
    assert result.num_tokens == len(prompt) - 1
    did, pages = reserve(decode, prompt, params)
    assert decode.page_stats().pinned == len(pages)
    copy_pages(decode, prefill, result.pages[: len(pages)], pages)  # stands in for the messenger
    prefill.release(pid)
    decode.kv_ready(did)
    while not decode.request(did).finished:
        decode.step()
    return list(decode.request(did).output_ids)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("length", [2, 9, 40])
def test_split_equals_plain(kind: str, length: int, tiny, tiny_engine_dir) -> None:
    params = SamplingParams(max_tokens=10)
    prompt = prompt_of(length, length)
    plain = tiny_engine(tiny_engine_dir(kind)).generate([prompt], params)[0]
    prefill = tiny_engine(tiny_engine_dir(kind), chunk=7, budget=7)  # several chunks, pages shared by chunks
    decode = tiny_engine(tiny_engine_dir(kind))
    assert split_generate(prefill, decode, prompt, params) == plain
    assert prefill.page_stats().used == 0 and decode.page_stats().used == 0


def test_prefill_returns_last_hidden_and_logits(tiny, tiny_engine_dir) -> None:
    _, hf = tiny("llama")
    prompt = prompt_of(17, 4)
    engine = tiny_engine(tiny_engine_dir("llama"))
    pid = engine.add_request(prompt, kind=RequestKind.PREFILL_ONLY, want_last_hidden=True)
    engine.step()
    result = engine.prefill_result(pid)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt[:-1]]), output_hidden_states=True)
    torch.testing.assert_close(result.last_logits, ref.logits[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(result.last_hidden, ref.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)
    assert result.num_tokens == len(prompt) - 1 and not engine.request(pid).output_ids  # nothing sampled


def test_split_smollm2(smollm2_dir) -> None:
    cfg = EngineConfig(engine_dir=smollm2_dir, num_pages=64)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    assert prefill.tokenizer is not None
    prompt = prefill.tokenizer.encode("Name three primary colours.", chat=True)
    params = SamplingParams(max_tokens=16)
    plain = prefill.generate([prompt], params)[0]
    assert split_generate(prefill, decode, prompt, params) == plain


def test_abort_while_waiting_for_kv_defers_free_until_unpinned(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"))
    rid, pages = reserve(engine, prompt_of(30, 2), SamplingParams(max_tokens=4))
    engine.pin_pages(pages)  # a transfer still targets these pages
    assert engine.abort(rid)
    assert engine.page_stats().used == len(pages)  # not reusable while a write may land
    engine.unpin_pages(pages)
    assert engine.page_stats().used == 0


def test_landed_kv_joins_the_next_step_beside_the_running_decodes(tiny_engine_dir) -> None:
    """The handover costs no step of its own: the request whose KV landed runs its last prompt token
    in the same step as the streams already decoding, and that step yields tokens for all of them."""
    params = SamplingParams(max_tokens=8)
    running_prompts = [prompt_of(12, 1), prompt_of(15, 2)]
    late = prompt_of(21, 3)
    plain = tiny_engine(tiny_engine_dir("llama")).generate([*running_prompts, late], params)
    prefill, decode = tiny_engine(tiny_engine_dir("llama")), tiny_engine(tiny_engine_dir("llama"))
    running = [decode.add_request(p, params) for p in running_prompts]
    decode.step()  # both prefilled: each has its first token and decodes from here on
    pid = prefill.add_request(late, kind=RequestKind.PREFILL_ONLY)
    while prefill.request(pid).state is not RequestState.PREFILLED:
        prefill.step()
    did, pages = reserve(decode, late, params)
    copy_pages(decode, prefill, prefill.prefill_result(pid).pages[: len(pages)], pages)
    prefill.release(pid)
    assert decode.load().decoding == 2
    decode.kv_ready(did)
    outs = {o.request_id: o for o in decode.step()}  # one step: two decodes and the handover together
    assert set(outs) == {*running, did} and all(len(o.new_token_ids) == 1 for o in outs.values())
    while decode.has_unfinished():
        decode.step()
    assert [list(decode.request(r).output_ids) for r in (*running, did)] == plain

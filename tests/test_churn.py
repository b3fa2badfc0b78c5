"""200 random requests with random cancellations on a small pool: every page comes back (also with
MTP speculation: rejected positions and the MTP layer's pages too)."""

from __future__ import annotations

import random

import pytest

from tests.helpers import prompt_of, tiny_engine, try_reserve
from torch_engine.config import SpecMethod, SpeculativeConfig
from torch_engine.request import FinishReason, RequestKind, RequestState
from torch_engine.sampling import SamplingParams


@pytest.mark.parametrize("drafter", ["none", "mtp"])
def test_random_requests_and_cancellations_free_every_page(drafter: str, tiny_engine_dir, mtp_engine_dir) -> None:
    rng = random.Random(7)
    # 40 pages of 4 tokens: far fewer than the load needs, so admission waits and preemption happen
    mtp = drafter == "mtp"
    spec = SpeculativeConfig(method=SpecMethod.MTP, num_tokens=1) if mtp else None
    engine_dir = mtp_engine_dir("llama") if mtp else tiny_engine_dir("llama")
    engine = tiny_engine(engine_dir, num_pages=40, chunk=16, budget=32, max_num_seqs=8, speculative=spec)
    ids: list[str] = []
    kinds: dict[str, RequestKind] = {}
    submitted = 0
    while submitted < 200 or engine.has_unfinished() or engine.waiting_for_kv() or engine.prefilled():
        for _ in range(rng.randrange(0, 4)):
            if submitted >= 200:
                break
            prompt = prompt_of(rng.randrange(1, 60), submitted)
            params = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.8]), seed=submitted)
            roll = rng.random()
            reserved = try_reserve(engine, prompt, params) if roll < 0.1 and len(prompt) > 1 else None
            if reserved is not None:
                rid = reserved[0]
                kinds[rid] = RequestKind.DECODE_FROM_KV
            elif roll < 0.2:
                rid = engine.add_request(prompt, params, kind=RequestKind.PREFILL_ONLY)
                kinds[rid] = RequestKind.PREFILL_ONLY
            else:
                rid = engine.add_request(prompt, params)
                kinds[rid] = RequestKind.GENERATE
            ids.append(rid)
            submitted += 1
        engine.step()
        for rid in list(engine.waiting_for_kv()):  # KV "arrives", or the transfer fails
            if rng.random() < 0.3:
                engine.kv_ready(rid)
            elif rng.random() < 0.1:
                engine.kv_failed(rid, "simulated transfer failure")
        for rid in list(engine.prefilled()):  # the KV was sent
            if rng.random() < 0.5:
                engine.release(rid)
        if rng.random() < 0.15:  # cancel a random request in whatever state it is
            engine.abort(rng.choice(ids))
        stats = engine.page_stats()
        assert stats.free + stats.used == stats.total
    assert all(engine.request(i).finished for i in ids)
    assert engine.page_stats().used == 0 and engine.page_stats().pinned == 0
    reasons = {engine.request(i).finish_reason for i in ids}
    assert {FinishReason.ABORT, FinishReason.LENGTH} <= reasons
    assert engine.num_preemptions > 0  # the pool really ran out
    assert any(engine.request(i).state is RequestState.FAILED for i in ids)
    assert (engine.spec_stats.proposed > 0) == mtp


def test_preemption_keeps_greedy_outputs(tiny_engine_dir) -> None:
    prompts = [prompt_of(20 + 3 * i, 100 + i) for i in range(6)]
    params = SamplingParams(max_tokens=24)
    roomy = tiny_engine(tiny_engine_dir("llama")).generate(prompts, params)
    tight = tiny_engine(tiny_engine_dir("llama"), num_pages=24, chunk=8, budget=16)
    assert tight.generate(prompts, params) == roomy
    assert tight.num_preemptions > 0

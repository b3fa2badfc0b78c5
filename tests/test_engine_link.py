"""Prefill engine -> messenger (layer-streamed, thread) -> decode engine equals plain generation."""

from __future__ import annotations

import time

import pytest
import torch

from kv_messenger.decode_side import DecodeSide
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.transport import MemoryFabric
from serving.kv_links import DecodeLink, PrefillLink, engine_layout, metadata_bytes
from tests.helpers import mtp_reference, prompt_of, start_split, tiny_engine
from torch_engine.config import DType, SpecMethod, SpeculativeConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import RequestKind
from torch_engine.sampling import SamplingParams
from torch_engine.scheduler import SchedulerOutput


def linked(kind: str, tiny_engine_dir, fabric: MemoryFabric, decode_spec=None, kv_dtype=None, **prefill_kw):
    prefill = tiny_engine(tiny_engine_dir(kind), kv_dtype=kv_dtype, **prefill_kw)
    decode = tiny_engine(tiny_engine_dir(kind), speculative=decode_spec, kv_dtype=kv_dtype)
    pside = PrefillSide(
        fabric.agent("p0"),
        engine_layout(prefill.kv_export()),
        prefill.kv_export().pools,
        prefill.kv_export().progress,
        metadata_bytes(prefill.kv_export()),
    )
    dside = DecodeSide(
        fabric.agent("d0"),
        engine_layout(decode.kv_export()),
        decode.kv_export().pools,
        metadata_bytes(decode.kv_export()),
        8,
    )
    pside.connect([dside.endpoint()])
    dside.connect([pside.endpoint()])
    return prefill, decode, PrefillLink(prefill, pside), DecodeLink(decode, dside, ["p0"], timeout_s=30), pside


def run_split(prefill, decode, plink, dlink, pside, prompts, params, meta: bool) -> tuple[list[str], list[list[int]]]:
    """Every prompt split: decode link -> prefill link -> messenger -> decode engine, until all finished."""
    pside.start()
    try:
        ids = []
        for i, prompt in enumerate(prompts):
            req = start_split(dlink, prompt, params, f"r{i}", seed=i, meta=meta)
            plink.submit(req)
            ids.append(req.request_id)
        for _ in range(2000):
            plink.step()
            plink.poll()
            assert dlink.poll().failed == []
            decode.step()
            if all(decode.has_request(i) and decode.request(i).finished for i in ids) and not prefill.has_unfinished():
                break
        return ids, [decode.request(i).output_ids for i in ids]
    finally:
        pside.stop()


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_disaggregated_equals_plain(kind: str, tiny_engine_dir) -> None:
    prompts = [prompt_of(n, n) for n in (3, 17, 40, 66)]
    params = SamplingParams(max_tokens=9)
    plain = tiny_engine(tiny_engine_dir(kind)).generate(prompts, params)
    prefill, decode, plink, dlink, pside = linked(kind, tiny_engine_dir, MemoryFabric(), chunk=8, budget=24)
    _, outputs = run_split(prefill, decode, plink, dlink, pside, prompts, params, meta=True)
    assert outputs == plain
    while plink.poll() or plink.live():  # the last FINs
        pass
    assert prefill.page_stats().used == 0 and decode.page_stats().used == 0
    # the handed-over metadata is the prefill's last hidden state
    ref = tiny_engine(tiny_engine_dir(kind))
    rid = ref.add_request(prompts[2], kind=RequestKind.PREFILL_ONLY, want_last_hidden=True)
    while ref.has_unfinished():
        ref.step()
    got = decode.request("r2").prefill_hidden  # handed to the engine with the request (kv_ready)
    hidden = ref.request(rid).last_hidden
    assert got is not None and hidden is not None
    torch.testing.assert_close(got, hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_bf16_pages_cross_the_split_as_they_are(kind: str, tiny_engine_dir) -> None:
    """fp32 engines on bf16 pages (``kv_dtype``; MLA's latents too): the decode engine receives the prefill's
    pages byte for byte, half the bytes of fp32 pages, and generates what one engine on bf16 pages generates."""
    prompts = [prompt_of(n, n) for n in (3, 17, 40, 66)]
    params = SamplingParams(max_tokens=9)
    plain = tiny_engine(tiny_engine_dir(kind), kv_dtype=DType.BFLOAT16).generate(prompts, params)
    prefill, decode, plink, dlink, pside = linked(
        kind, tiny_engine_dir, MemoryFabric(), kv_dtype=DType.BFLOAT16, chunk=8, budget=24, prefix_cache=False
    )
    p_layout, d_layout = engine_layout(prefill.kv_export()), engine_layout(decode.kv_export())
    assert p_layout == d_layout and p_layout.dtype is DType.BFLOAT16
    fp32 = engine_layout(tiny_engine(tiny_engine_dir(kind)).kv_export())
    assert 2 * p_layout.dtype.itemsize == fp32.dtype.itemsize and p_layout.compat_hash() != fp32.compat_hash()
    sent: list[list[torch.Tensor]] = []  # r3's pages on the prefill once computed (before they are freed)
    received: list[list[torch.Tensor]] = []  # and on the decode engine at its first step (before it writes one)

    class Keep:
        def __init__(self, engine: LLMEngine, into: list[list[torch.Tensor]], before: bool) -> None:
            self.engine, self.into, self.before = engine, into, before

        def keep(self, sched: SchedulerOutput) -> None:
            for c in sched.chunks:
                if c.request.request_id == "r3" and not self.into and (self.before or c.completes):
                    self.into.append([p[c.request.pages].clone() for p in self.engine.kv_export().pools])

        def before_step(self, sched: SchedulerOutput) -> None:
            if self.before:
                self.keep(sched)

        def after_forward(self, sched: SchedulerOutput) -> None:
            if not self.before:
                self.keep(sched)

    prefill.attach(Keep(prefill, sent, False))
    decode.attach(Keep(decode, received, True))
    _, outputs = run_split(prefill, decode, plink, dlink, pside, prompts, params, meta=True)
    assert outputs == plain and len(sent) == len(received) == 1
    n = len(prompts[3]) // 4  # r3's whole pages of prompt (page size 4)
    for a, b in zip(sent[0], received[0], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a[:n], b[:n])


def test_decoder_timeout_frees_pages_and_serves_next(tiny_engine_dir) -> None:
    _, decode, plink, dlink, pside = linked("llama", tiny_engine_dir, MemoryFabric())
    dlink.timeout_s = 0.2
    start_split(dlink, prompt_of(30, 1), SamplingParams(max_tokens=4), "lost")  # never sent to the prefill
    used = decode.page_stats().used
    assert used > 0
    time.sleep(0.3)
    failed = dlink.poll().failed
    assert failed and "timed out" in failed[0][1]
    assert decode.request("lost").error is not None
    assert decode.page_stats().used == used  # no sender confirmed: quarantined, not reused
    dlink.side.grace_s = 0.0
    dlink.poll()
    assert decode.page_stats().used == 0
    pside.start()
    try:
        req = start_split(dlink, prompt_of(12, 2), SamplingParams(max_tokens=3), "next")
        plink.submit(req)
        while not (decode.has_request("next") and decode.request("next").finished):
            plink.step()
            dlink.poll()
            decode.step()
    finally:
        pside.stop()
    assert len(decode.request("next").output_ids) == 3


def test_dropped_write_fails_request_and_reclaims_pages(tiny_engine_dir) -> None:
    prefill, decode, plink, dlink, pside = linked("llama", tiny_engine_dir, MemoryFabric())
    dlink.timeout_s = 0.5
    pside.transport.faults.drop_next = 1  # the first KV transfer is lost
    plink.submit(start_split(dlink, prompt_of(25, 3), SamplingParams(max_tokens=4), "victim"))
    healthy_prompt = prompt_of(10, 4)
    pside.start()
    try:
        deadline = time.monotonic() + 10
        failed: list[tuple[str, str]] = []
        while not failed and time.monotonic() < deadline:
            plink.step()
            failed = dlink.poll().failed
            decode.step()
        assert failed and failed[0][0] == "victim" and "timed out" in failed[0][1]
        assert decode.request("victim").error == failed[0][1]
        while decode.page_stats().used and time.monotonic() < deadline:  # FIN came: pages are reclaimable
            dlink.poll()
        assert decode.page_stats().used == 0
        plink.submit(start_split(dlink, healthy_prompt, SamplingParams(max_tokens=5), "after"))
        while not (decode.has_request("after") and decode.request("after").finished):
            plink.step()
            dlink.poll()
            decode.step()
    finally:
        pside.stop()
    plain = tiny_engine(tiny_engine_dir("llama")).generate([healthy_prompt], SamplingParams(max_tokens=5))[0]
    assert decode.request("after").output_ids == plain
    assert prefill.page_stats().used == 0


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_disaggregated_mtp_drafts_from_the_shipped_hidden_state(kind: str, mtp_engine_dir, mtp_tiny) -> None:
    """Decoder drafting with MTP, prefill streaming every layer (the MTP layer's KV included) and
    the last hidden state: greedy tokens equal plain decoding; the hidden state the decoder's engine
    got equals the prefill's; the first step verifies a draft (one step earlier than without the
    hand-off), which equals Hugging Face's MTP reference at the prefill's last position, and is
    accepted when that draft is the token plain decoding emits first."""
    prompts = [prompt_of(n, n) for n in (3, 17, 40)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = tiny_engine(mtp_engine_dir(kind)).generate(prompts, params)
    spec = SpeculativeConfig(method=SpecMethod.MTP, num_tokens=1)
    prefill, decode, plink, dlink, pside = linked(
        kind, lambda _k: mtp_engine_dir(kind), MemoryFabric(), decode_spec=spec, chunk=8, budget=24
    )
    first: dict[str, tuple[int, tuple[int, ...]]] = {}

    class FirstSteps:
        def before_step(self, sched: SchedulerOutput) -> None:
            for c in sched.chunks:
                first.setdefault(c.request.request_id, (c.start, c.draft))

        def after_forward(self, sched: SchedulerOutput) -> None:
            pass

    decode.attach(FirstSteps())
    ids, outputs = run_split(prefill, decode, plink, dlink, pside, prompts, params, decode.wants_prefill_hidden)
    assert outputs == plain
    _, hf = mtp_tiny(kind)
    for i, rid in enumerate(ids):
        prompt = prompts[i]
        ref = tiny_engine(mtp_engine_dir(kind))
        pid = ref.add_request(prompt, kind=RequestKind.PREFILL_ONLY, want_last_hidden=True)
        while ref.has_unfinished():
            ref.step()
        got, want = decode.request(rid).prefill_hidden, ref.request(pid).last_hidden
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        start, draft = first[rid]
        expected = mtp_reference(hf, prompt + plain[i])[len(prompt) - 2]  # MTP at n - 2 drafts token n
        assert start == len(prompt) - 1 and draft == (expected,), rid
        assert decode.request(rid).spec.steps >= 1
    accepted = [d == (p[0],) for (_, d), p in zip((first[r] for r in ids), plain, strict=True)]
    assert decode.spec_stats.accepted >= sum(accepted)
    assert prefill.page_stats().used == 0 and decode.page_stats().used == 0

"""Prefill engine -> messenger (layer-streamed, thread) -> decode engine equals plain generation."""

from __future__ import annotations

import time

import pytest
import torch

from kv_messenger.decode_side import DecodeSide
from kv_messenger.prefill_side import PrefillSide
from kv_messenger.transport import MemoryFabric
from serving.kv_links import DecodeLink, PrefillLink, engine_layout, metadata_bytes
from tests.helpers import tiny_engine
from tests.test_engine_equivalence import prompt_of
from torch_engine.request import RequestKind
from torch_engine.sampling import SamplingParams


def linked(kind: str, tiny_engine_dir, fabric: MemoryFabric, **prefill_kw):
    prefill = tiny_engine(tiny_engine_dir(kind), **prefill_kw)
    decode = tiny_engine(tiny_engine_dir(kind))
    pside = PrefillSide(
        fabric.agent("p0"), engine_layout(prefill), prefill.kv.pools, prefill.progress, metadata_bytes(prefill)
    )
    dside = DecodeSide(fabric.agent("d0"), engine_layout(decode), decode.kv.pools, metadata_bytes(decode), 8)
    pside.connect([dside.endpoint()])
    dside.connect([pside.endpoint()])
    return prefill, decode, PrefillLink(prefill, pside), DecodeLink(decode, dside, ["p0"], timeout_s=30), pside


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_disaggregated_equals_plain(kind: str, tiny_engine_dir) -> None:
    prompts = [prompt_of(n, n) for n in (3, 17, 40, 66)]
    params = SamplingParams(max_tokens=9)
    plain = tiny_engine(tiny_engine_dir(kind)).generate(prompts, params)
    prefill, decode, plink, dlink, pside = linked(kind, tiny_engine_dir, MemoryFabric(), chunk=8, budget=24)
    pside.start()
    try:
        ids = []
        for i, prompt in enumerate(prompts):
            req = dlink.start(prompt, params, f"r{i}", seed=i, meta=True)
            plink.submit(req)
            ids.append(req.request_id)
        for _ in range(2000):
            plink.step()
            plink.poll()
            assert dlink.poll().failed == []
            decode.step()
            if all(decode.has_request(i) and decode.request(i).finished for i in ids) and not prefill.has_unfinished():
                break
        outputs = [decode.request(i).output_ids for i in ids]
    finally:
        pside.stop()
    assert outputs == plain
    while plink.poll() or plink.live():  # the last FINs
        pass
    assert prefill.page_stats().used == 0 and decode.page_stats().used == 0
    # the handed-over metadata is the prefill's last hidden state and logits
    ref = tiny_engine(tiny_engine_dir(kind))
    rid = ref.add_request(prompts[2], kind=RequestKind.PREFILL_ONLY, want_last_hidden=True)
    while ref.has_unfinished():
        ref.step()
    got = dlink.take_metadata("r2")
    hidden = ref.request(rid).last_hidden
    assert got is not None and hidden is not None
    torch.testing.assert_close(got[: hidden.numel()], hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[hidden.numel() :], ref.request(rid).last_logits, atol=1e-5, rtol=1e-5)


def test_decoder_timeout_frees_pages_and_serves_next(tiny_engine_dir) -> None:
    _, decode, plink, dlink, pside = linked("llama", tiny_engine_dir, MemoryFabric())
    dlink.timeout_s = 0.2
    dlink.start(prompt_of(30, 1), SamplingParams(max_tokens=4), "lost")  # never sent to the prefill
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
        req = dlink.start(prompt_of(12, 2), SamplingParams(max_tokens=3), "next")
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
    plink.submit(dlink.start(prompt_of(25, 3), SamplingParams(max_tokens=4), "victim"))
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
        plink.submit(dlink.start(healthy_prompt, SamplingParams(max_tokens=5), "after"))
        while not (decode.has_request("after") and decode.request("after").finished):
            plink.step()
            dlink.poll()
            decode.step()
    finally:
        pside.stop()
    plain = tiny_engine(tiny_engine_dir("llama")).generate([healthy_prompt], SamplingParams(max_tokens=5))[0]
    assert decode.request("after").output_ids == plain
    assert prefill.page_stats().used == 0

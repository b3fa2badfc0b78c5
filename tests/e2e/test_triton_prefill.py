"""Disaggregated through Triton: a prefill node (tritonserver, `prefill` model) streams KV over
NIXL into a decode engine in this process; tokens equal plain generation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from kv_messenger.decode_side import DecodeSide
from kv_messenger.protocol import RankEndpoint
from kv_messenger.transport.nixl import NixlTransport
from orchestrator.triton import Ports, TritonServer
from serving.kv_links import DecodeLink, engine_layout, metadata_bytes
from tests.helpers import metric, prompt_of, start_split, tiny_engine
from torch_engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def call(client: httpclient.InferenceServerClient, name: str, payload: str) -> dict[str, np.ndarray]:
    t = httpclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([payload.encode()], dtype=np.object_))
    result = client.infer("prefill", [t])
    return {o: result.as_numpy(o) for o in ("endpoint", "load_tokens") if result.as_numpy(o) is not None}


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_prefill_node_over_triton(kind: str, tiny_engine_dir, tmp_path: Path) -> None:
    engine_dir = tiny_engine_dir(kind)
    node = tmp_path / "node.yaml"
    settings = (
        f"engine: {{engine_dir: {engine_dir}, num_pages: 256, "
        "scheduler: {max_prefill_chunk: 8, max_num_batched_tokens: 16}}\n"
    )
    node.write_text(settings + f"agent_name: prefill-{kind}\n", encoding="utf-8")
    srv = TritonServer(ROOT / "model_repo", tmp_path / "run", node, Ports.free(), models=("prefill",))
    srv.start()
    decode = tiny_engine(engine_dir)
    side = DecodeSide(
        NixlTransport(f"decode-{kind}"),
        engine_layout(decode.kv_export()),
        decode.kv_export().pools,
        metadata_bytes(decode.kv_export()),
        4,
    )
    try:
        client = httpclient.InferenceServerClient(srv.http_url)
        out = call(client, "handshake", json.dumps([json.loads(side.endpoint().model_dump_json())]))
        prefill_ep = RankEndpoint.model_validate_json(out["endpoint"].reshape(-1)[0])
        side.connect([prefill_ep])
        link = DecodeLink(decode, side, [prefill_ep.agent], timeout_s=60)
        prompts = [prompt_of(n, n) for n in (5, 23, 41)]
        params = SamplingParams(max_tokens=8)
        loads = []
        for i, p in enumerate(prompts):
            req = start_split(link, p, params, f"r{i}", seed=i)
            loads.append(int(call(client, "prefill_request", req.model_dump_json())["load_tokens"][0]))
        assert loads[0] == 4 and all(x > 0 for x in loads)
        deadline = time.monotonic() + 60

        def done() -> bool:
            return all(decode.has_request(f"r{i}") and decode.request(f"r{i}").finished for i in range(3))

        while time.monotonic() < deadline and not done():
            assert link.poll().failed == []
            decode.step()
        got = [decode.request(f"r{i}").output_ids for i in range(3)]
        client.close()

        deadline = time.monotonic() + 10  # the last FIN, then the metrics
        while metric(srv, "disagg_kv_transfer_seconds_count") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(srv, "disagg_kv_transfer_seconds_count") == 3
        assert metric(srv, "disagg_kv_transfer_bytes_total") > 0
    finally:
        side.transport.close()
        assert srv.stop() == 0, srv.log_tail()
    assert got == tiny_engine(engine_dir).generate(prompts, params)
    assert decode.page_stats().used == 0

"""The router without a deployment: decode groups replaced by fake upstream streams (what each group
answers is scripted), served by the real aiohttp app; stop strings cut across pieces."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend import generation
from frontend.config import GroupEndpoint, RouterConfig, RouterSpec
from frontend.groups import Group, GroupPool
from frontend.server import Router
from frontend.text import StopCutter
from frontend.upstream import GroupUnavailable, Piece, Refused
from tests.router_harness import Script, ScriptedPool, healthy, scripted_router
from torch_engine.sampling import SamplingParams


async def down(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    raise GroupUnavailable(f"{name}: connection refused")
    yield  # pragma: no cover


async def breaks_after_one(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    yield Piece((ids[-1],), 0, 1, "")
    raise GroupUnavailable(f"{name}: stream reset")


async def refuses(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
    raise Refused("prompt has 9999 tokens; the context holds 2048")
    yield  # pragma: no cover


def run(
    smollm2_dir: Path, scripts: dict[str, Script], monkeypatch: pytest.MonkeyPatch, body: dict[str, object]
) -> tuple[int, str, dict[str, Group]]:
    router, pool = scripted_router(smollm2_dir, scripts, monkeypatch)

    async def go() -> tuple[int, str]:
        async with TestClient(TestServer(router.app())) as client:
            r = await client.post("/v1/completions", json={"model": "smollm2", "max_tokens": 3} | body)
            return r.status, await r.text()

    status, text = asyncio.run(go())
    return status, text, {g.name: g for g in pool.groups}


def test_a_group_down_before_the_first_token_is_retried_once_elsewhere(smollm2_dir, monkeypatch) -> None:
    status, text, groups = run(smollm2_dir, {"a": down, "b": healthy}, monkeypatch, {"prompt": "x y"})
    assert status == 200, text
    body = json.loads(text)
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
    assert not groups["a"].up and "connection refused" in groups["a"].why_down and groups["b"].up
    assert groups["a"].outstanding == groups["b"].outstanding == 0 and groups["b"].in_flight == 0


def test_no_group_left_is_a_503_in_openai_shape(smollm2_dir, monkeypatch) -> None:
    status, text, _ = run(smollm2_dir, {"a": down, "b": down}, monkeypatch, {"prompt": "x"})
    assert status == 503
    error = json.loads(text)["error"]
    assert error["type"] == "server_error" and "a: connection refused" in error["message"]


def test_a_refusal_is_a_400_and_not_retried(smollm2_dir, monkeypatch) -> None:
    status, text, groups = run(smollm2_dir, {"a": refuses, "b": refuses}, monkeypatch, {"prompt": "x"})
    assert status == 400 and "context holds 2048" in json.loads(text)["error"]["message"]
    assert groups["a"].up and groups["b"].up  # the group answered: it stays in rotation


def test_a_stream_that_breaks_mid_way_ends_with_an_error_event(smollm2_dir, monkeypatch) -> None:
    status, text, _ = run(smollm2_dir, {"a": breaks_after_one}, monkeypatch, {"prompt": "x", "stream": True})
    assert status == 200
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert "stream reset" in json.loads(events[-2])["error"]["message"]


def test_the_least_loaded_group_is_picked() -> None:
    pool = GroupPool.of([GroupEndpoint(name=n, grpc_url="x") for n in ("a", "b", "c")])
    for g in pool.groups:
        g.up = True
    with pool.track(pool.groups[0], 100, 50), pool.track(pool.groups[1], 10, 20) as t:
        assert pool.pick(set()) == (pool.groups[2], 0)
        assert pool.pick({"c"}) == (pool.groups[1], 0)
        t.progress(5)  # 15 tokens left to generate: the prompt no longer counts
        assert pool.groups[1].outstanding == 15
    assert [g.outstanding for g in pool.groups] == [0, 0, 0]
    pool.groups[2].up = False
    assert pool.pick(set()) == (pool.groups[0], 0)


@pytest.mark.parametrize(
    ("pieces", "stops", "want"),
    [
        (["Hello wor", "ld, and", " more"], ("world",), "Hello "),
        (["a</", "s> b"], ("</s>",), "a"),
        (["abc", "def"], ("xyz",), "abcdef"),
        (["ab", "c"], ("cd", "bx"), "abc"),  # held back while it could start a stop, released at the end
        (["STOP here"], ("STOP",), ""),
    ],
)
def test_stop_strings_are_cut_across_pieces(pieces: list[str], stops: tuple[str, ...], want: str) -> None:
    cut = StopCutter(stops)
    assert "".join(cut.feed(p) for p in pieces) + cut.flush() == want


def test_client_chosen_paths_do_not_grow_the_metrics(smollm2_dir: Path) -> None:
    """Unbounded state: a random path (refused 401 without the key, 404 with it) is counted under
    one "other" route, never as a new Prometheus series of its own."""
    cfg = RouterConfig(
        spec=RouterSpec(port=1, api_key="k"), model_name="smollm2", engine_dir=smollm2_dir,
        groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")],
    )  # fmt: skip
    router = Router(cfg, ScriptedPool.of(cfg.groups))
    auth = {"Authorization": "Bearer k"}

    async def go() -> str:
        async with TestClient(TestServer(router.app())) as client:
            for i in range(40):
                assert (await client.post(f"/random/{i}", json={})).status == 401
                assert (await client.get(f"/v1/x{i}", headers=auth)).status == 404
            return await (await client.get("/metrics", headers=auth)).text()

    labels = set(re.findall(r'disagg_router_requests_total\{route="([^"]*)"', asyncio.run(go())))
    assert labels == {"other"}


def test_the_router_config_is_owner_only(smollm2_dir: Path, tmp_path: Path) -> None:
    """It carries the API key: 0600 from its creation, also when it replaces a file of another mode."""
    cfg = RouterConfig(
        spec=RouterSpec(port=1, api_key="k"), model_name="smollm2", engine_dir=smollm2_dir,
        groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")],
    )  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text("old", encoding="utf-8")
    path.chmod(0o644)
    cfg.dump(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert RouterConfig.load(path).spec.api_key == "k"


def test_n_choices_follow_their_first_on_its_group_after_its_first_token(smollm2_dir, monkeypatch) -> None:
    """``n: 3`` over two prompts: each prompt's later choices start only after its first choice's first
    piece, on that choice's group (its prefix cache holds the prompt now), seeds seed + j; choices in order."""
    calls: list[tuple[str, tuple[int, ...], int | None]] = []
    first_piece: dict[tuple[int, ...], int] = {}  # prompt -> index in ``calls`` when its first piece went out

    def recording(name: str):
        async def script(_: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
            calls.append((name, tuple(ids), s.seed))
            await asyncio.sleep(0.01)
            first_piece.setdefault(tuple(ids), len(calls))
            async for piece in healthy(name, ids, s):
                yield piece

        return script

    body = {"prompt": ["one two", "three four five"], "n": 3, "seed": 7}
    status, text, _ = run(smollm2_dir, {"a": recording("a"), "b": recording("b")}, monkeypatch, body)
    assert status == 200, text
    answer = json.loads(text)
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    for prompt in {ids for _, ids, _ in calls}:
        mine = [(i, name, seed) for i, (name, ids, seed) in enumerate(calls) if ids == prompt]
        assert sorted(seed or 0 for _, _, seed in mine) == [7, 8, 9]
        lead = next(c for c in mine if c[2] == 7)
        assert all(name == lead[1] and i >= first_piece[prompt] for i, name, seed in mine if seed != 7)
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(len(ids) for ids in {ids for _, ids, _ in calls})  # each prompt once
    assert usage["completion_tokens"] == 6 * 3


def test_several_choices_stream_under_their_index(smollm2_dir, monkeypatch) -> None:
    body = {"prompt": ["one two", "three"], "n": 2, "stream": True, "echo": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, text, _ = run(smollm2_dir, {"a": healthy, "b": healthy}, monkeypatch, body)
    assert status == 200, text
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    by_index: dict[int, list[dict[str, Any]]] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, got in by_index.items():
        assert got[0]["text"].startswith(("one two", "three")[i // 2])  # echo: the prompt first
        assert [c["finish_reason"] for c in got][-1] == "length" and all(c["finish_reason"] is None for c in got[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 4 * 3


def test_tokenize_and_detokenize_use_the_deployment_tokenizer(smollm2_dir) -> None:
    cfg = RouterConfig(spec=RouterSpec(port=1), model_name="smollm2", engine_dir=smollm2_dir,
                       groups=[GroupEndpoint(name="a", grpc_url="127.0.0.1:1")])  # fmt: skip
    router = Router(cfg, ScriptedPool.of(cfg.groups))
    tok = router.gen.tokenizer

    async def go() -> list[tuple[int, dict[str, Any]]]:
        async with TestClient(TestServer(router.app())) as client:
            out = []
            for path, body in (
                ("/tokenize", {"model": "smollm2", "prompt": "Hello world"}),
                ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                ("/detokenize", {"tokens": tok.encode("Hello world")}),
                ("/detokenize", {"tokens": [10**9]}),
                ("/tokenize", {"prompt": "x", "messages": []}),
                ("/tokenize", {"model": "gpt-4o", "prompt": "x"}),
            ):
                r = await client.post(path, json=body)
                out.append((r.status, await r.json()))
            info = await client.get("/tokenizer_info")
            body = await info.json()
            assert info.status == 200 and body["chat_template"] == tok.hf.chat_template and body["tokenizer_class"]
            assert body["eos_token"] == tok.hf.eos_token and "name_or_path" not in body
            return out

    (s1, a), (s2, b), (s3, c), (s4, d), (s5, e), (s6, f) = asyncio.run(go())
    assert s1 == 200 and a["tokens"] == tok.encode("Hello world") and a["count"] == len(a["tokens"])
    assert s2 == 200 and b["tokens"] == tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert s3 == 200 and c["prompt"] == "Hello world"
    assert s4 == 400 and "outside the vocabulary" in d["error"]["message"]
    assert s5 == 400 and "exactly one of prompt and messages" in e["error"]["message"]
    assert s6 == 404 and f["error"]["code"] == "model_not_found"


def test_best_of_returns_the_n_most_likely_choices(smollm2_dir, monkeypatch) -> None:
    """``best_of: 3, n: 2``: three choices per prompt (seeds 7, 8, 9), the two with the highest summed
    log-probability returned, best first; usage counts all three completions."""

    async def by_seed(name: str, ids: list[int], s: SamplingParams) -> AsyncGenerator[Piece, None]:
        seed = s.seed or 0
        assert s.logprobs is not None  # asked for internally: the ranking needs them
        for i in range(1, 4):
            yield Piece(
                (1000 + seed,) * i, i - 1, i, "length" if i == 3 else "", (-abs(seed - 9.0),), ((1,),), ((0.0,),)
            )

    body = {"prompt": "x", "n": 2, "best_of": 3, "seed": 7}
    status, text, _ = run(smollm2_dir, {"a": by_seed}, monkeypatch, body)
    assert status == 200, text
    answer = json.loads(text)
    tok = generation.Tokenizer(smollm2_dir)
    assert [c["text"] for c in answer["choices"]] == [tok.decode([1009] * 3), tok.decode([1008] * 3)]
    assert all(c["logprobs"] is None for c in answer["choices"])  # not asked for by the client
    assert answer["usage"]["completion_tokens"] == 9
    status, text, _ = run(smollm2_dir, {"a": by_seed}, monkeypatch, body | {"stream": True})
    assert status == 400 and "cannot stream" in text

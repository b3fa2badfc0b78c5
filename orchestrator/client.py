"""asyncio client of a deployment over Triton gRPC streaming (``stream_infer``), with token timestamps.

``generate`` sends one request to the ``llm`` ensemble (text in, streamed text out);
``generate_ids`` sends token ids to the ``decode`` model and returns the generated ids (used
where there is no tokenizer, and to compare outputs token for token). Each call has its own
stream, so concurrency is just ``asyncio.gather``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import tritonclient.grpc.aio as aioclient

from serving.codecs import DECODE, DecodeCall, encode_decode, encode_llm, parse_piece, parse_text_output
from serving.names import Model, Tensor
from serving.node_config import GRPC_AUTH_HEADER
from serving.wire import SIGNATURES, client_inputs
from torch_engine.sampling import SamplingParams


@dataclass(slots=True)
class Completion:
    request_id: str
    sent: float  # time.time() when the request went out
    pieces: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.time() of each non-empty piece
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int | None = None  # the router's usage (its last event), when it sent one
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def llm_inputs(
    prompt: str,
    max_tokens: int,
    stream: bool = True,
    chat: bool = False,
    ignore_eos: bool = False,
    cache_salt: str | None = None,
) -> list[object]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, cache_salt=cache_salt)
    return client_inputs(SIGNATURES[Model.LLM], encode_llm(prompt, params, stream, chat))


async def _one(request: dict) -> AsyncIterator[dict]:
    yield request


def _headers(key: str | None) -> dict[str, str] | None:
    return {GRPC_AUTH_HEADER: key} if key else None


async def generate(
    client: aioclient.InferenceServerClient,
    prompt: str,
    max_tokens: int,
    request_id: str,
    chat: bool = False,
    timeout_s: float = 600.0,
    on_piece: Callable[[str], None] | None = None,
    ignore_eos: bool = False,
    key: str | None = None,
    cache_salt: str | None = None,
) -> Completion:
    """Stream one completion from ``llm``; every non-empty text piece is timestamped on arrival.
    ``key``: the deployment's secret (``RUN_DIR/secret``) where its nodes restrict inference;
    ``cache_salt``: share cached KV only with requests of the same salt."""
    req = {
        "model_name": Model.LLM.value,
        "inputs": llm_inputs(prompt, max_tokens, True, chat, ignore_eos, cache_salt),
        "request_id": request_id,
        "enable_empty_final_response": True,
    }
    done = Completion(request_id, time.time())
    async for result, error in client.stream_infer(_one(req), stream_timeout=timeout_s, headers=_headers(key)):
        if error is not None:
            done.error = str(error)
            break
        piece = parse_text_output(result.as_numpy) if result.as_numpy(Tensor.TEXT_OUTPUT) is not None else ""
        if piece:
            done.pieces.append(piece)
            done.times.append(time.time())
            if on_piece is not None:
                on_piece(piece)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    return done


async def generate_ids(
    client: aioclient.InferenceServerClient,
    prompt_ids: list[int],
    max_tokens: int,
    request_id: str,
    timeout_s: float = 600.0,
    key: str | None = None,
) -> Completion:
    """All generated token ids of one request to the ``decode`` model (one response: stream=false)."""
    call = DecodeCall(prompt_ids, SamplingParams(max_tokens=max_tokens), stream=False)
    inputs = client_inputs(DECODE, encode_decode(call))
    req = {"model_name": Model.DECODE.value, "inputs": inputs, "request_id": request_id}
    done = Completion(request_id, time.time())
    async for result, error in client.stream_infer(_one(req), stream_timeout=timeout_s, headers=_headers(key)):
        if error is not None:
            done.error = str(error)
        else:
            done.token_ids = list(parse_piece(result.as_numpy, None).window)
            done.times.append(time.time())
        break
    return done


async def chat_via_router(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    api_key: str | None = None,
    on_piece: Callable[[str], None] | None = None,
    timeout_s: float = 600.0,
) -> Completion:
    """One streamed greedy chat completion through the router's OpenAI API, timestamped."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    return await _via_router(f"{base_url}/chat/completions", body, "router-demo", api_key, on_piece, timeout_s)


async def complete_via_router(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    request_id: str,
    ignore_eos: bool = False,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    cache_salt: str | None = None,
) -> Completion:
    """One streamed greedy text completion through the router (``X-Request-Id`` names it on the decode node)."""
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": ignore_eos,
        "stream_options": {"include_usage": True},
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return await _via_router(f"{base_url}/completions", body, request_id, api_key, None, timeout_s)


async def _via_router(
    url: str,
    body: dict[str, object],
    request_id: str,
    api_key: str | None,
    on_piece: Callable[[str], None] | None,
    timeout_s: float,
) -> Completion:
    """POST one streamed request; every non-empty text piece of the server-sent events is timestamped."""
    import aiohttp

    headers = {"X-Request-Id": request_id} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    done = Completion(request_id, time.time())
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.post(url, json=body, headers=headers) as r,
    ):
        if r.status != 200:
            done.error = f"HTTP {r.status}: {await r.text()}"
            return done
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                done.error = str(event["error"].get("message"))
                break
            usage = event.get("usage")
            if usage:
                done.prompt_tokens = usage["prompt_tokens"]
                done.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            choice = event["choices"][0] if event["choices"] else {}
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if piece:
                done.pieces.append(piece)
                done.times.append(time.time())
                if on_piece is not None:
                    on_piece(piece)
    return done

"""`make image-test`'s checks against a running image (host network): the demo answer through the router, and the
project's greedy-equality prompts through Triton gRPC (`llm`) and the router, each equal to the engine run here on
the same weights and dtype. Exit status 0 when all hold."""

from __future__ import annotations

import asyncio
import sys

from builders import BuildOptions, build_engine
from builders.build import DEFAULT_ENGINE_CACHE, default_engine_dir
from orchestrator.client import chat_via_router, complete_via_router, generate
from serving.grpc_channel import aio_client
from torch_engine.config import DType, EngineConfig, Role
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

ROUTER = "http://127.0.0.1:8080/v1"
TRITON = "127.0.0.1:8001"
N = 32
TEXT = ["The capital of France is", "def fibonacci(n):"]
CHAT = "Explain in one sentence why the sky is blue."


def reference() -> tuple[list[str], str]:
    opts = BuildOptions(role=Role.DECODE, dtype=DType.FLOAT32, page_size=16)
    engine_dir = build_engine("smollm2", default_engine_dir(DEFAULT_ENGINE_CACHE, "smollm2", opts), opts, False)
    engine = LLMEngine(EngineConfig(engine_dir=engine_dir, num_pages=256, dtype="auto"))
    tok = engine.tokenizer
    assert tok is not None
    params = SamplingParams(max_tokens=N)
    text = [tok.decode(ids) for ids in engine.generate(TEXT, params)]
    chat = tok.decode(engine.generate([tok.encode(CHAT, chat=True)], params)[0])
    return text, chat


async def served() -> tuple[str, list[str], list[str], str]:
    demo = await chat_via_router(ROUTER, "smollm2", "What is the capital of France? Answer in one sentence.", 32)
    client = aio_client(TRITON)
    try:
        grpc = [await generate(client, p, N, f"image-{i}") for i, p in enumerate(TEXT)]
    finally:
        await client.close()
    routed = [await complete_via_router(ROUTER, "smollm2", p, N, f"image-r{i}") for i, p in enumerate(TEXT)]
    chat = await chat_via_router(ROUTER, "smollm2", CHAT, N)
    for c in [demo, *grpc, *routed, chat]:
        if c.error:
            raise SystemExit(f"request {c.request_id} failed: {c.error}")
    return demo.text, [c.text for c in grpc], [c.text for c in routed], chat.text


def main() -> int:
    demo, grpc, routed, chat = asyncio.run(served())
    want_text, want_chat = reference()
    print(f"demo: {demo!r}")
    checks = {
        "demo answer names Paris": "Paris" in demo,
        "Triton gRPC llm == engine": grpc == want_text,
        "router completions == engine": routed == want_text,
        "router chat == engine": chat == want_chat,
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if not all(checks.values()):
        print(f"got {grpc} / {routed} / {chat!r}; want {want_text} / {want_chat!r}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

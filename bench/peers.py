"""The engine benchmark's peers on the same weights, threads and dtype: HF transformers (prefill
forward, ``generate`` with its KV cache) and, when installed (``make bench-peers``), llama.cpp."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from torch_engine.config import EngineManifest
from torch_engine.loader import EngineDescription


@dataclass(frozen=True, slots=True)
class PeerPoint:
    """llama.cpp at batch 1 on the same weights and threads."""

    weights: str
    prefill_tok_s: float
    decode_tok_s: float
    decode_step_ms: float
    engine_decode_over_peer: float = 0.0
    step_over_floor: float = 0.0  # the batch-1 floor of the same thread count


def hf_run(model: torch.nn.Module, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds): one forward over the prompts, and ``generate`` with
    ``decode_tokens + 1`` new tokens minus ``generate`` with 1 (so HF's own prefill cancels out)."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    generate: Callable[..., object] = model.generate  # type: ignore[assignment]

    def gen(n: int) -> float:
        t = time.perf_counter()
        generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - t0
        decode = gen(decode_tokens + 1) - gen(1)
    return prefill, max(decode, 1e-9)


def load_hf(engine_dir: Path, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    source = Path(EngineManifest.load(engine_dir).source)
    model: torch.nn.Module
    if source.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    return torch.nn.Module.to(model, torch.device(device)).eval()


def llamacpp_point(
    info: EngineDescription, engine_dir: Path, prompt: list[int], decode_tokens: int, repeats: int, threads: int,
    engine_tok_s: float,
) -> PeerPoint | None:  # fmt: skip
    """llama.cpp decoding the engine's GGUF source requantised to the engine's dtype (a ``prompt``
    prefill, then ``decode_tokens`` single-token decodes, median of ``repeats``); None (said) when
    the binding is not installed or the engine was not built from a GGUF file."""
    try:
        import llama_cpp
    except ImportError:
        print("[bench] llama.cpp peer skipped: not installed (make bench-peers)", flush=True)
        return None
    source = Path(info.source)
    if source.suffix != ".gguf":
        print(f"[bench] llama.cpp peer skipped: {source.name} is not a GGUF file", flush=True)
        return None
    kind = "BF16" if info.dtype == torch.bfloat16 else "F32"
    weights = engine_dir / f"llamacpp-{kind}.gguf"
    if not weights.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16 if kind == "BF16" else llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(weights).encode(), params) != 0:
            print("[bench] llama.cpp peer skipped: requantising the GGUF failed", flush=True)
            return None
    n_ctx = len(prompt) + decode_tokens + 8
    llm = llama_cpp.Llama(
        model_path=str(weights),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        n_batch=len(prompt),
        verbose=False,
    )
    pre, dec = [], []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for i in range(decode_tokens):
            llm.eval([prompt[i]])
        dec.append(time.perf_counter() - t1)
        pre.append(t1 - t0)
    d = statistics.median(dec)
    point = PeerPoint(
        weights=kind,
        prefill_tok_s=len(prompt) / statistics.median(pre),
        decode_tok_s=decode_tokens / d,
        decode_step_ms=1e3 * d / decode_tokens,
    )
    point = replace(point, engine_decode_over_peer=engine_tok_s / point.decode_tok_s)
    print(
        f"threads {threads} llama.cpp ({kind}) batch 1: prefill {point.prefill_tok_s:7.0f} tok/s  decode "
        f"{point.decode_tok_s:6.1f} tok/s  step {point.decode_step_ms:.1f} ms; engine / llama.cpp "
        f"x{point.engine_decode_over_peer:.2f}",
        flush=True,
    )
    return point

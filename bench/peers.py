"""The engine benchmark's peers on the same weights, threads and dtype: HF transformers (prefill
forward, ``generate`` with its KV cache) and, when installed (``make bench-peers``), llama.cpp."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

import torch

from torch_engine.config import EngineManifest
from torch_engine.loader import EngineDescription


@dataclass(frozen=True, slots=True)
class PeerPoint:
    """llama.cpp on one GGUF file at the engine benchmark's threads: batch 1 (its high-level ``eval``)
    and batched (the low-level ``llama_batch``, one sequence per row in one context)."""

    weights: str  # "as-stored Q4_1" (the engine's own source file) or the requantisation's type
    prefill_tok_s: float
    decode_tok_s: float
    decode_step_ms: float
    batched_decode_tok_s: dict[int, float] = field(default_factory=dict)  # batch -> aggregate tok/s
    engine_decode_over_peer: float = 0.0
    step_over_floor: float = 0.0  # the batch-1 floor of the same thread count
    build: str = ""  # llama.cpp's system info: the instruction sets it was built with


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


def llamacpp_points(
    info: EngineDescription, engine_dir: Path, prompt: list[int], decode_tokens: int, repeats: int, threads: int,
    batches: list[int],
) -> list[PeerPoint]:  # fmt: skip
    """llama.cpp decoding the engine's GGUF source as stored, and requantised to the engine's dtype
    (a ``prompt`` prefill, then ``decode_tokens`` decode steps, median of ``repeats``; batched: the
    same prompt in each of ``batches`` sequences). Empty (said) when the binding is not installed or
    the engine was not built from a GGUF file."""
    try:
        import llama_cpp
    except ImportError:
        print("[bench] llama.cpp peer skipped: not installed (make bench-peers)", flush=True)
        return []
    source = Path(info.source)
    if source.suffix != ".gguf":
        print(f"[bench] llama.cpp peer skipped: {source.name} is not a GGUF file", flush=True)
        return []
    kind = "BF16" if info.dtype == torch.bfloat16 else "F32"
    files = [(f"as-stored {_stored_type(source)}", source)]
    requantised = engine_dir / f"llamacpp-{kind}.gguf"
    if not requantised.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16 if kind == "BF16" else llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(requantised).encode(), params) != 0:
            print("[bench] llama.cpp requantisation failed: only the file as stored", flush=True)
    if requantised.exists():
        files.append((kind, requantised))
    points, build = [], llamacpp_build_info(llama_cpp)
    for name, path in files:
        point = replace(_batch1(llama_cpp, path, name, prompt, decode_tokens, repeats, threads), build=build)
        for b in (b for b in batches if b > 1):
            point.batched_decode_tok_s[b] = _batched(llama_cpp, path, prompt, decode_tokens, repeats, threads, b)
        points.append(point)
        batched = "  ".join(f"batch {b}: {t:6.1f} tok/s" for b, t in point.batched_decode_tok_s.items())
        print(
            f"threads {threads} llama.cpp ({name}) batch 1: prefill {point.prefill_tok_s:7.0f} tok/s  decode "
            f"{point.decode_tok_s:6.1f} tok/s  step {point.decode_step_ms:.1f} ms  {batched}",
            flush=True,
        )
    return points


def _stored_type(path: Path) -> str:
    """The file's type as llama.cpp names it (``general.file_type``: Q4_1 for the embedded SmolLM2, Q4_K_M
    for a mix), else its most common tensor type among its 2-D weights."""
    from collections import Counter

    from gguf import LlamaFileType

    from builders.gguf_file import read_gguf

    reader = read_gguf(path)
    field = reader.fields.get("general.file_type")
    if isinstance(field, int):
        try:
            return LlamaFileType(field).name.removeprefix("MOSTLY_")
        except ValueError:
            pass  # a type this gguf version does not know: fall back to the tensors
    types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) == 2)
    return types.most_common(1)[0][0] if types else "?"


def _batch1(
    llama_cpp: ModuleType, path: Path, name: str, prompt: list[int], decode_tokens: int, repeats: int, threads: int
) -> PeerPoint:
    llm = llama_cpp.Llama(
        model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + decode_tokens + 8,
        n_batch=len(prompt), verbose=False,
    )  # fmt: skip
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
    return PeerPoint(name, len(prompt) / statistics.median(pre), decode_tokens / d, 1e3 * d / decode_tokens)


_QUIET: list[object] = []  # the binding keeps a pointer to the log callback: it must outlive every call


def _batched(
    llama_cpp: ModuleType, path: Path, prompt: list[int], decode_tokens: int, repeats: int, threads: int, batch: int
) -> float:
    """Aggregate decode tok/s of ``batch`` sequences in one context (``n_seq_max = batch``), each step
    one ``llama_decode`` of one token per sequence; the prompts are prefilled first, untimed."""
    if not _QUIET:
        _QUIET.append(llama_cpp.llama_log_callback(lambda level, text, user: None))
        llama_cpp.llama_log_set(_QUIET[0], None)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = batch * (len(prompt) + decode_tokens + 8)
    p.n_batch = p.n_ubatch = min(batch * len(prompt), 2048)
    p.n_seq_max, p.n_threads, p.n_threads_batch = batch, threads, threads
    ctx = llama_cpp.llama_init_from_model(model, p)
    rows = llama_cpp.llama_batch_init(max(p.n_batch, batch), 0, batch)
    try:

        def decode(tokens: list[tuple[int, int, int]]) -> None:  # (token, position, sequence)
            rows.n_tokens = len(tokens)
            for i, (t, pos, seq) in enumerate(tokens):
                rows.token[i], rows.pos[i], rows.n_seq_id[i], rows.seq_id[i][0] = t, pos, 1, seq
                rows.logits[i] = pos >= len(prompt) or pos == len(prompt) - 1
            if llama_cpp.llama_decode(ctx, rows) != 0:
                raise RuntimeError("llama_decode failed")

        runs = []
        for _ in range(repeats):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            everything = [(t, i, s) for s in range(batch) for i, t in enumerate(prompt)]
            for lo in range(0, len(everything), p.n_batch):
                decode(everything[lo : lo + p.n_batch])
            t0 = time.perf_counter()
            for k in range(decode_tokens):
                decode([(prompt[k], len(prompt) + k, s) for s in range(batch)])
            runs.append(time.perf_counter() - t0)
        return batch * decode_tokens / statistics.median(runs)
    finally:
        llama_cpp.llama_batch_free(rows)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


# llama.cpp's CMake switches for what this CPU has (``make bench-peers``): its portable build is AVX2-only,
# and GGML_NATIVE=ON died with an illegal instruction on these machines, so the flags are named one by one.
_GGML_FLAGS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "amx_tile": "GGML_AMX_TILE",
    "amx_int8": "GGML_AMX_INT8",
    "amx_bf16": "GGML_AMX_BF16",
}


def llamacpp_cmake_args() -> str:
    """``CMAKE_ARGS`` building llama.cpp for this CPU's instruction sets (the peer at its best here)."""
    from torch_engine.cpu import cpu_info

    have = cpu_info().flags
    return " ".join(["-DGGML_NATIVE=OFF", *(f"-D{opt}=ON" for flag, opt in _GGML_FLAGS.items() if flag in have)])


def llamacpp_build_info(llama_cpp: ModuleType) -> str:
    """What the installed binding was built with (its system info line)."""
    return bytes(llama_cpp.llama_print_system_info()).decode(errors="replace").strip()


if __name__ == "__main__":
    print(llamacpp_cmake_args())

"""What the compiled row ops save a 256-token prefill of SmolLM2, piece by piece, in one process.

For each piece of a layer, PyTorch's way (what the eager model ran before) and the compiled one, on the shapes of
SmolLM2's 256-token prefill in bf16, alternated over ``--rounds`` rounds of ``--reps`` calls each (medians of the
rounds, ms a call): SiLU(gate) * up, and the rotary embedding of q / k with the K / V write. Times 30 layers: the ms
a prefill saves (with the inputs hot in cache: in the engine each piece's input comes from the GEMM before it).

Run from the repository root: ``.venv/bin/python benchmarks/row-ops-2026-12-04/ops.py [--threads 1 2] OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from torch_engine.config import KVLayout
from torch_engine.cpu import cpu_info
from torch_engine.kernels import cpu_kernels
from torch_engine.kv_cache import KVCacheSpec, PagedKVCache
from torch_engine.layers import apply_rope

T, HIDDEN, INTER, HQ, HKV, D, LAYERS = 256, 576, 1536, 9, 3, 64, 30


def timed(fn: Callable[[], object], reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def pieces(kernels: ModuleType) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Each piece: (PyTorch's way, the compiled way)."""
    bf = torch.bfloat16
    gate_up = torch.randn(T, 2 * INTER).to(bf)

    def silu_torch() -> object:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    spec = KVCacheSpec(1, 32, 16, KVLayout.HND, bf, kv_heads=HKV, head_dim=D)
    torch_kv, fused_kv = PagedKVCache(spec), PagedKVCache(spec)
    fused_kv.kernels = kernels
    qkv = torch.randn(T, HQ + 2 * HKV, D).to(bf)
    angle = torch.rand(T, D // 2) * 100
    cos, sin = angle.cos().to(bf), angle.sin().to(bf)
    pages, offsets = torch.arange(T) // 16, torch.arange(T) % 16

    def rope_torch() -> object:
        qk = apply_rope(qkv[:, : HQ + HKV], cos, sin)
        torch_kv.write_kv(0, qk[:, HQ:], qkv[:, HQ + HKV :], pages, offsets)
        return qk[:, :HQ].contiguous()  # the attention kernel's q

    def rope_fused() -> object:
        x = qkv.clone()  # the kernel rotates in place; the clone is timed against the torch side's new tensors
        fused_kv.rope_write_kv(0, x, HQ, cos, sin, pages, offsets)
        return x[:, :HQ].contiguous()

    return {"silu_mul": (silu_torch, lambda: kernels.silu_mul(gate_up)), "rope+kv": (rope_torch, rope_fused)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("out")
    a = p.parse_args()
    kernels = cpu_kernels()
    assert kernels is not None, "the kernels cannot be built here"
    result: dict[str, object] = {
        "cpu": cpu_info().as_dict(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for threads in a.threads:
        torch.set_num_threads(threads)
        per: dict[str, dict[str, float]] = {}
        for name, (before, now) in pieces(kernels).items():
            before(), now()
            runs: dict[str, list[float]] = {"torch": [], "compiled": []}
            for i in range(a.rounds):
                for side, fn in (
                    (("torch", before), ("compiled", now)) if i % 2 == 0 else (("compiled", now), ("torch", before))
                ):
                    runs[side].append(timed(fn, a.reps))
            per[name] = {s: statistics.median(v) for s, v in runs.items()}
            print(threads, name, {s: round(v, 3) for s, v in per[name].items()}, flush=True)
        saved = sum(v["torch"] - v["compiled"] for v in per.values()) * LAYERS
        result[str(threads)] = {"pieces_ms_a_call": per, "saved_ms_a_prefill": saved}
        print(threads, "saved a prefill (30 layers):", round(saved, 1), "ms", flush=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

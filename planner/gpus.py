"""GPU profiles from published figures: a roofline per step, for models too large to measure here.

Per GPU (vendor data sheets, SXM / HGX parts; dense FLOP/s, no sparsity):

| GPU  | memory | HBM / GDDR bandwidth | BF16 | FP8 | GPU-GPU in a node | NIC share |
|------|-------:|--------------------:|-----:|----:|------------------:|----------:|
| H100 | 80 GB  | 3.35 TB/s | 989 TFLOP/s | 1,979 | NVLink 450 GB/s per direction | 400 Gb/s |
| H200 | 141 GB | 4.8 TB/s  | 989 | 1,979 | NVLink 450 GB/s | 400 Gb/s |
| L40S | 48 GB  | 864 GB/s  | 362 | 733 | PCIe Gen4 x16, 32 GB/s | 200 Gb/s |
| B200 | 180 GB | 8 TB/s    | 2,250 | 4,500 | NVLink 900 GB/s | 400 Gb/s |

A step of T tokens (a prefill chunk, or a decode batch of B sequences at context C) on an instance
of N GPUs takes the larger of its compute time and its memory time, plus its collectives and a
fixed per-step overhead:

- compute: ``2 x active params x T`` + attention FLOPs, over ``N x FLOP/s x MFU``;
- memory: the parameters the step reads (``ModelShape.params_read``: MoE reads only the experts its
  tokens route to) plus the batch's KV, over ``N x bandwidth x MBU``;
- collectives over the GPU-GPU link (the NIC once an instance spans nodes): a dense model is tensor
  parallel (two all-reduces of ``T x hidden`` BF16 per layer, not overlapped); a MoE model is
  expert parallel (per MoE layer each GPU sends its ``T / N`` tokens to ``k`` experts in FP8 and
  gets them back in BF16, overlapped with compute as DeepSeek's two micro-batches do; the
  latencies are not hidden);
- the KV moves between instances over their NICs (each GPU sends its share).

The efficiency assumptions (MFU, MBU, overheads) are declared once in ``Efficiency``; the planner's
report prints them next to its answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.model_shape import ModelShape
from planner.profile import DecodeGrid, HardwareProfile, ProfileSource


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_gb: float
    bandwidth_tbs: float  # HBM / GDDR
    bf16_tflops: float
    fp8_tflops: float
    intra_node_gbs: float  # GPU-GPU per direction inside a node
    nic_gbps: float  # network share of one GPU (Gb/s)
    per_node: int = 8


GPUS = {
    g.name: g
    for g in (
        GpuSpec("H100", 80, 3.35, 989, 1979, 450, 400),
        GpuSpec("H200", 141, 4.8, 989, 1979, 450, 400),
        GpuSpec("L40S", 48, 0.864, 362, 733, 32, 200),
        GpuSpec("B200", 180, 8.0, 2250, 4500, 900, 400),
    )
}


@dataclass(frozen=True, slots=True)
class Efficiency:
    mfu: float = 0.5  # achieved / peak FLOP/s in compute-bound steps (prefill)
    mbu: float = 0.7  # achieved / peak bandwidth in memory-bound steps (decode)
    step_overhead_s: float = 0.002  # scheduling, sampling, launch per step (CUDA graphs assumed)
    collective_latency_s: float = 8e-6  # one collective inside a node
    cross_node_latency_s: float = 25e-6  # one collective over the NIC
    transfer_latency_s: float = 2e-4  # one KV transfer (NIXL over RDMA)
    memory_headroom: float = 0.9  # share of GPU memory for weights + KV


@dataclass(frozen=True, slots=True)
class Precision:
    weight_bytes: float = 1.0  # FP8 weights
    kv_bytes: float = 2.0  # BF16 KV
    fp8_compute: bool = True


class DoesNotFit(ValueError):
    pass


def _step_s(
    shape: ModelShape, gpu: GpuSpec, n: int, tokens: int, kv_tokens: float, context: float, p: Precision, e: Efficiency
) -> float:
    flops = 2.0 * shape.active_params * tokens + shape.attention_flops(tokens, context)
    peak = (gpu.fp8_tflops if p.fp8_compute else gpu.bf16_tflops) * 1e12
    compute = flops / (n * peak * e.mfu)
    read = shape.params_read(tokens) * p.weight_bytes + kv_tokens * shape.kv_elements_per_token() * p.kv_bytes
    memory = read / (n * gpu.bandwidth_tbs * 1e12 * e.mbu)
    if n == 1:
        return max(compute, memory) + e.step_overhead_s
    cross = n > gpu.per_node
    link = (gpu.nic_gbps / 8 if cross else gpu.intra_node_gbs) * 1e9
    latency = e.cross_node_latency_s if cross else e.collective_latency_s
    h = shape.cfg.hidden_size
    if shape.moe_layers:  # expert parallel: each GPU's tokens go to k experts (FP8) and come back (BF16), overlapped
        sent = tokens / n * shape.cfg.num_experts_per_tok * h * 3.0
        comm_bytes, comm_latency = shape.moe_layers * sent / link, 2 * shape.moe_layers * latency
        return max(compute, memory, comm_bytes) + comm_latency + e.step_overhead_s
    per = latency + 2.0 * (n - 1) / n * tokens * h * 2 / link  # tensor parallel: two all-reduces per layer
    return max(compute, memory) + 2 * shape.cfg.num_layers * per + e.step_overhead_s


PREFILL_TOKENS = (1, 64, 256, 1024, 4096, 16384, 65536)
DECODE_BATCHES = (1, 8, 32, 64, 128, 256, 512)
DECODE_CONTEXTS = (512, 2048, 8192, 32768)


def roofline_profile(
    shape: ModelShape, gpu: GpuSpec, devices: int, precision: Precision | None = None, eff: Efficiency | None = None
) -> HardwareProfile:
    """The cost curves of one instance of ``devices`` GPUs serving ``shape``; DoesNotFit when its
    weights leave no room for KV."""
    p, e = precision or Precision(), eff or Efficiency()
    weights = shape.total_params * p.weight_bytes
    room = devices * gpu.memory_gb * 1e9 * e.memory_headroom - weights
    kv_token = shape.kv_elements_per_token() * p.kv_bytes
    if room < kv_token * 4096:
        raise DoesNotFit(
            f"{shape.name} needs {weights / 1e9:.0f} GB of weights: {devices} x {gpu.name} "
            f"({devices * gpu.memory_gb:.0f} GB) leaves no room for KV"
        )
    prefill = [(t, _step_s(shape, gpu, devices, t, 0, t / 2, p, e)) for t in PREFILL_TOKENS]
    grid = [[_step_s(shape, gpu, devices, b, b * c, c, p, e) for c in DECODE_CONTEXTS] for b in DECODE_BATCHES]
    return HardwareProfile(
        name=f"{gpu.name} x {devices}",
        source=ProfileSource.ROOFLINE,
        model=shape.name,
        device={
            "gpu": gpu.name,
            "assumptions": f"MFU {e.mfu}, MBU {e.mbu}, step overhead {1e3 * e.step_overhead_s:g} ms, "
            f"weights {p.weight_bytes:g} B, KV {p.kv_bytes:g} B per element",
        },
        devices=devices,
        prefill=prefill,
        decode=DecodeGrid(batches=list(DECODE_BATCHES), contexts=list(DECODE_CONTEXTS), seconds=grid),
        kv_bytes_per_token=math.ceil(kv_token),
        link_bytes_per_s=devices * gpu.nic_gbps / 8 * 1e9,
        link_latency_s=e.transfer_latency_s,
        max_batch_tokens=int(room // kv_token),
    )

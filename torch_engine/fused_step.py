"""The CPU engine's decode-only steps in one compiled call (``torch_engine/csrc/decode_step.cpp``).

A decode node's steady state is a batch of single-token rows. On the fast CPU path the eager model
spends half of such a step between its ops (Python, ~1,500 small ATen calls); ``FusedStep`` runs
every layer of the step — norms, the integer GEMMs, rotary, the KV write, paged attention, the
SiLU-gated MLP, the residual adds — inside one C++ call with one OpenMP region, and bumps the
per-layer progress counter as the eager model does. The embedding lookup before it and the lm_head
after it stay where they are (one call each).

Which models: Llama-family GQA (``LlamaAttention`` + ``GatedMLP``: Llama, SmolLM2, Mistral-style, Qwen2
biases, Qwen3 q/k norms), TP 1, every layer GEMM kept as stored (``Linear.quant``: the GGUF's Q4_0 /
Q4_1 / Q8_0), or every one dense bf16 packed for ``vdpbf16ps`` (``Linear.vnni``: an HF checkpoint's weights
in the bf16 engine of a CPU with AVX-512 BF16), or every one dense fp32 (the fp32 engine of an HF checkpoint,
an AVX2 CPU's ``auto``: the model's own weights, no copy), rotary over the whole head, CPU. Which steps: decode-only
(``StepInputs.decode_only``). Anything else runs the eager model. Numerics: activations and the residual
stream in fp32 (the eager model keeps them in the engine's dtype), K / V stored in the pool's dtype; each
GEMM's input rounded to int8 blocks (packed weights: the eager path's kernel), to bf16 (dense bf16: the
eager path's ``vdpbf16ps`` product) or not at all (dense fp32), so the two paths differ only in where they
round.
"""

from __future__ import annotations

from types import ModuleType

import torch

from torch_engine.kv_cache import PagedKVCache
from torch_engine.layer_progress import LayerProgress
from torch_engine.layers import GatedMLP, Linear, RMSNorm, RotaryTable
from torch_engine.models.decoder import CausalLM, DecoderLayer
from torch_engine.models.llama import LlamaAttention
from torch_engine.parallel import TPGroup

_NONE = torch.empty(0)
DENSE = -1  # ``decode_step.cpp``'s kind of a dense bf16 weight (``bf16gemm.h``)
DENSE_F32 = -2  # of a dense fp32 weight (``f32gemm.h``)
# Dense fp32 steps of more rows go to the eager model: there oneDNN's blocked GEMMs beat f32gemm.h's dot
# products over the unpacked weight (SmolLM2 at one thread, AVX-512 Zen 4: the fused step 1.4-1.9x the eager
# one at 1 row, about even at 8, 0.8-0.9x at 16; BENCHMARKS.md)
DENSE_F32_ROWS = 8


def why_not_fused(model: CausalLM, kv: PagedKVCache, tp: TPGroup, device: torch.device) -> str | None:
    """None if ``FusedStep`` can run this model's decode steps, else the reason it cannot."""
    if device.type != "cpu":
        return f"device {device.type}"
    if tp.size != 1:
        return f"TP {tp.size}"
    if kv.spec.is_mla or kv.spec.dtype not in (torch.float32, torch.bfloat16):
        return "MLA or a KV dtype other than fp32 / bf16"
    if model.rotary_dim != model.cfg.head_dim:
        return "a partial rotary embedding"
    kinds: set[int] = set()  # how each GEMM's weight is held
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.attn, layer.mlp
        if not isinstance(attn, LlamaAttention) or type(mlp) is not GatedMLP:
            return f"layers of {type(attn).__name__} / {type(mlp).__name__}"
        for lin in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            kind = _kind(lin)
            if kind is None:
                return "GEMM weights neither kept as stored, nor dense bf16 packed for AVX-512 BF16, nor dense fp32"
            kinds.add(min(kind, 0))  # the way it is held: packed (any quant kind, >= 0), dense bf16, dense fp32
    if len(kinds) > 1:
        return "GEMM weights held in more than one way (kept as stored, dense bf16, dense fp32)"
    return None


class FusedStep:
    """One model's decode steps on the compiled path; build with ``why_not_fused(...) is None``."""

    def __init__(
        self, model: CausalLM, kv: PagedKVCache, progress: LayerProgress, rope: RotaryTable, kernels: ModuleType
    ) -> None:
        cfg, spec = model.cfg, kv.spec
        first, mlp0 = model.layers[0].attn, model.layers[0].mlp
        assert isinstance(first, LlamaAttention) and isinstance(mlp0, GatedMLP)
        first_lin = first.qkv
        strides = kv.strides()  # every layer's pool has the same shape
        self._dtype = kv.compute_dtype
        self._embed = model.embed
        self._step = kernels.FusedDecoder(
            cfg.hidden_size, first.hq, first.hkv, first.d, mlp0.down.in_features, cfg.rms_norm_eps,
            spec.page_size, strides, rope.cos.float().contiguous(), rope.sin.float().contiguous(),
            model.norm.weight.detach(), progress.cpu_counts(),
        )  # fmt: skip
        for i, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.attn, layer.mlp
            assert isinstance(attn, LlamaAttention) and isinstance(mlp, GatedMLP)
            norms = [layer.attn_norm.weight, layer.mlp_norm.weight, _norm(attn.q_norm), _norm(attn.k_norm)]
            lins = [attn.qkv, attn.o, mlp.gate_up, mlp.down]
            self._step.add_layer(
                [n.detach() for n in norms], [_parts(lin) for lin in lins], [_held(lin) for lin in lins],
                [lin.out_features for lin in lins], kv.pools[i],
            )  # fmt: skip
        self.steps = 0  # decode steps served (tests, metrics)
        dense32 = _kind(first_lin) == DENSE_F32
        self.max_rows: int | None = DENSE_F32_ROWS if dense32 else None  # None: any step

    def takes(self, rows: int) -> bool:
        """Whether a decode-only step of ``rows`` rows runs here (else on the eager model)."""
        return self.max_rows is None or rows <= self.max_rows

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, kv_lens: torch.Tensor
    ) -> torch.Tensor:
        """Final-norm hidden states ``[B, hidden]`` (the engine's dtype) of a decode-only step."""
        table, kernels = self._embed.quant, self._embed.quant_kernels
        h = table.rows(kernels, input_ids) if table is not None and kernels is not None else self._embed(input_ids)
        out = self._step.run(h, positions, tables, kv_lens)  # fp32 rows from a table kept as stored
        self.steps += 1
        return out if self._dtype == torch.float32 else out.to(self._dtype)


def _norm(n: RMSNorm | None) -> torch.Tensor:
    return n.weight if n is not None else _NONE


def _parts(lin: Linear) -> list[torch.Tensor]:
    bias = lin.bias.detach() if lin.bias is not None else _NONE
    q = lin.quant
    if q is not None:
        return [q.qs, q.d, q.m, bias]
    if lin.vnni is not None:
        return [lin.vnni, _NONE, _NONE, bias]
    return [lin.weight.detach(), _NONE, _NONE, bias]


def _held(lin: Linear) -> int:
    kind = _kind(lin)
    assert kind is not None, "why_not_fused() passed this model"
    return kind


def _kind(lin: Linear) -> int | None:
    """``decode_step.cpp``'s kind of this GEMM's weight; None where it has no compiled GEMM."""
    if lin.quant is not None:
        return int(lin.quant.kind)
    if lin.vnni is not None:
        return DENSE
    w = lin.weight
    fits = w is not None and w.dtype == torch.float32 and w.is_contiguous() and lin.out_features % 16 == 0
    return DENSE_F32 if fits and lin.in_features % 32 == 0 else None

"""Building blocks shared by the model families: Linear, RMSNorm, RoPE tables, rotation, SiLU-gated MLP."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from torch_engine.config import ModelConfig, RopeScaling
from torch_engine.parallel import TPGroup
from torch_engine.quant import Grouped


class Linear(nn.Linear):
    """``nn.Linear`` with the CPU serving path (``prepare(kernels)``, fp32 or bf16 on a CPU).

    - The weight is reordered once into oneDNN's blocked layout; plain ``F.linear`` repacks it on
      every call. Measured here (SmolLM2's 121 GEMMs of one decode step, one thread): fp32 45 / 65 /
      77 / 106 ms plain at 1 / 4 / 8 / 16 rows against 39 / 30 / 42 / 57 ms packed; bf16 34 / 38 /
      41 / 52 against 20 / 17 / 23 / 33 ms. One to three rows are padded to four (oneDNN's
      four-row kernel beats its GEMV).
    - bf16 with up to ``SMALL_ROWS`` rows on a CPU with AVX-512 BF16: the compiled ``gemm_bf16`` over
      a copy packed for ``vdpbf16ps`` (``torch_engine/csrc/gemm_bf16.cpp``): 10 / 10 / 11 / 22 ms at
      1 / 2 / 4 / 8 rows against oneDNN's 18 / 19 / 19 / 24. More rows go to oneDNN.
    - Unpacked fp32 on a CPU pads 2- and 3-row inputs to 4 rows (MKL's 2-row GEMM cost 2.4x a
      1-row GEMV, its 3-row one 3.7x, 4 rows 2.4x).

    - A weight kept as the GGUF stored it (``set_quant``: Q8_0 / Q4_0 / Q4_1 grouped for the integer
      kernels, ``torch_engine/quant.py``): the compiled ``gemm_q8`` (the activations quantized to int8 per
      32-block, the weight read once per call) for any number of rows where the kernels are AVX-512 VNNI
      or AVX2 (prefill included: SmolLM2, 256 tokens, 1.2x / 1.45-1.8x the dequantise-and-GEMM prefill at
      1 / 2 threads on a Zen 4; the AVX2 build's GEMMs of one layer at 64 / 256 rows, one thread, 2.5x / 2.1x
      faster than dequantising and running MKL's fp32 GEMM), up to ``QUANT_ROWS`` rows on the scalar
      kernels (prefill there dequantises the weight and runs the dense GEMM).

    The original weight stays (tied embeddings).
    """

    SMALL_ROWS = 8
    QUANT_ROWS = 16
    packed: torch.Tensor | None = None  # oneDNN's layout
    vnni: torch.Tensor | None = None  # [N / 16, K / 2, 16, 2] for gemm_bf16
    kernels: ModuleType | None = None
    quant: Grouped | None = None
    quant_kernels: ModuleType | None = None
    quant_rows = QUANT_ROWS  # the most rows the integer kernel takes (set_quant: by its instruction set)
    # the lm_head: up to PRECISE_ROWS rows, the integer GEMM multiplies the activations' rounding residual too
    # (~250x less error for twice the dot products: free there, where reading the weight binds; +1.6 ms of a
    # 28 MB Q8_0 lm_head at 4 rows here, so larger batches keep one pass)
    precise: bool = False
    PRECISE_ROWS = 2

    def set_quant(self, weight: Grouped, dtype: torch.dtype, kernels: ModuleType) -> None:
        """Compute with ``weight`` as stored; the dense ``weight`` parameter goes away."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"a packed weight of shape {weight.shape} for a {self.out_features}x{self.in_features} Linear"
            )
        self.register_parameter("weight", None)
        self.quant, self.quant_kernels = weight, kernels
        self.quant_rows = 1 << 62 if kernels.i8_path() in ("avx512-vnni", "avx2") else self.QUANT_ROWS
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(dtype), requires_grad=False)

    def _quant_forward(self, x: torch.Tensor, q: Grouped, kernels: ModuleType) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= self.quant_rows:
            precise = self.precise and x2.shape[0] <= self.PRECISE_ROWS
            y = q.gemm(kernels, x2, self.bias if self.bias is not None else _NO_BIAS, precise)
        else:
            w = q.rows(kernels).to(x.dtype)
            y = F.linear(x2, w, None if self.bias is None else self.bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def prepare(self, kernels: ModuleType | None) -> None:
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return
        if torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 4)
        n, k = w.shape
        fits = w.dtype == torch.bfloat16 and n % 16 == 0 and k % 2 == 0
        if fits and kernels is not None and kernels.gemm_bf16_supported():
            self.vnni = w.detach().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
            self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and self.quant_kernels is not None:
            return self._quant_forward(x, self.quant, self.quant_kernels)
        rows = x.shape[0] if x.dim() == 2 else 0
        if self.kernels is not None and 0 < rows <= self.SMALL_ROWS and x.dtype == torch.bfloat16:
            bias = self.bias if self.bias is not None else _NO_BIAS
            return self.kernels.gemm_bf16(x, self.vnni, bias, self.out_features)
        if self.packed is not None and x.dtype == self.weight.dtype:
            if rows in (1, 2, 3):
                y = torch.ops.mkldnn._linear_pointwise(
                    F.pad(x, (0, 0, 0, 4 - rows)), self.packed, self.bias, "none", [], ""
                )
                return y[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if rows in (2, 3) and x.device.type == "cpu" and x.dtype == torch.float32:
            return F.linear(F.pad(x, (0, 0, 0, 4 - rows)), self.weight, self.bias)[:rows]
        return F.linear(x, self.weight, self.bias)


_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)
_ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled row kernels take


class Embedding(nn.Embedding):
    """``nn.Embedding``, or a table kept as stored (``set_quant``): the looked-up rows are dequantised."""

    quant: Grouped | None = None
    quant_kernels: ModuleType | None = None
    quant_dtype: torch.dtype = torch.float32

    def reset_parameters(self) -> None:
        """No random init: the model is built on the meta device and its weights are always loaded (``normal_``
        on a meta tensor imported ``torch._dynamo``: 3 s of every engine's start)."""

    def set_quant(self, weight: Grouped, dtype: torch.dtype, kernels: ModuleType) -> None:
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"a packed table of shape {weight.shape} for a {self.num_embeddings}-row embedding")
        self.register_parameter("weight", None)
        self.quant, self.quant_dtype, self.quant_kernels = weight, dtype, kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None or self.quant_kernels is None:
            return super().forward(ids)
        rows = self.quant.rows(self.quant_kernels, ids.reshape(-1)).to(self.quant_dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension. ``kernels`` (the engine's fast CPU path): the compiled
    one-pass kernel (2 us vs 16 us per call of ``F.rms_norm`` on a bf16 decode row here)."""

    kernels: ModuleType | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.device.type == "cpu":
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # one fused op; torch accumulates in fp32 for bf16 / fp16 inputs
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of a ``dim``-wide rotary embedding and its cos/sin scale (HF semantics)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if scaling.rope_type == "yarn":
        factor = scaling.factor
        orig = scaling.original_max_position_embeddings or max_positions
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low = float(max(math.floor(corr_dim(scaling.beta_fast)), 0))
        high = float(min(math.ceil(corr_dim(scaling.beta_slow)), dim - 1))
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv_freq, attention_factor
    return inv_freq, 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    scale = cfg.qk_head_dim**-0.5
    rs = cfg.rope_scaling
    if rs.rope_type != "default" and rs.mscale_all_dim:
        m = _yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale *= m * m
    return scale


class RotaryTable:
    """cos/sin for every position up to ``max_positions``, each ``[positions, dim // 2]`` (fp32)."""

    def __init__(self, dim: int, theta: float, scaling: RopeScaling, max_positions: int, device: torch.device) -> None:
        inv_freq, attn_scale = rope_inv_freq(dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = (freqs.cos() * attn_scale).to(device)
        self.sin = (freqs.sin() * attn_scale).to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``x`` (``[T, H, dim]``) with ``cos``/``sin`` (``[T, dim // 2]``, already in ``x``'s dtype).

    Non-interleaved pairs dimension i with i + dim/2 (HF ``rotate_half``). Interleaved pairs
    (2i, 2i+1) (DeepSeek) and returns the result de-interleaved: ``[rotated evens, rotated odds]``,
    the same permutation for q and k, so q . k is unchanged.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class GatedMLP(nn.Module):
    """SiLU-gated MLP, tensor parallel: ``gate_up`` column-sharded, ``down`` row-sharded. ``kernels`` (the
    engine's fast CPU path): SiLU(gate) * up in one compiled pass (SmolLM2's 256-token prefill, one thread: 0.30 ->
    0.16 ms a layer against PyTorch's two ops, ``benchmarks/row-ops-2026-12-04/ops.py``)."""

    kernels: ModuleType | None = None

    def __init__(self, hidden: int, local_intermediate: int, tp: TPGroup, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * local_intermediate, bias=False)
        self.down = Linear(local_intermediate, hidden, bias=False)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.kernels is not None and gate_up.device.type == "cpu" and gate_up.dtype in _ROW_DTYPES:
            mid = self.kernels.silu_mul(gate_up.reshape(-1, gate_up.shape[-1])).view(*gate_up.shape[:-1], -1)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            mid = F.silu(gate) * up
        out = self.down(mid)
        return self.tp.all_reduce(out) if self.reduce else out

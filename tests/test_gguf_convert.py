"""A GGUF's K-quants kept as stored, other formats converted at build time (``builders/gguf_convert.py``).

Reference: gguf's own dequantisation of the source blocks. Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 are kept as
stored (bit-equal), and IQ4_NL; IQ4_XS becomes IQ4_NL within its scales' fp16 rounding; the rest (the other IQ formats)
are requantized to Q8_0, each weight within half its new block step. End to end: the embedded SmolLM2 file rewritten
with its FFN-down tensors in Q4_K, Q5_K, Q6_K, Q3_K, IQ4_NL and Q2_K (by layer, as llama.cpp's mixes hold them), its q,
k, v in Q5_0 (as Q4_K_M does for rows that are not a multiple of 256) and its gate, up in Q5_1 (a Q5_K_M's fallback)
builds packed, and the engine on it decodes as on gguf's dequantisation of the same file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from bench.gguf_rewrite import rewrite
from bench.quality import prompt_logprobs, top1_agreement
from builders import BuildOptions, build_engine
from builders.checkpoint import Checkpoint
from builders.embedded import smollm2_gguf
from builders.gguf_convert import convert, converts, target
from builders.gguf_import import load_gguf
from builders.quantize import QuantReport, quantize_blocks, quantize_tensor
from tests.helpers import smollm2_prompts
from torch_engine.config import DType, EngineConfig, EngineManifest, WeightStorage
from torch_engine.engine import LLMEngine
from torch_engine.quant import Packed, QuantKind, Weight
from torch_engine.sampling import SamplingParams

T = GGMLQuantizationType


def _random_k_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant or an IQ4 format (every bit pattern is a valid block) with small fp16 scales."""
    weights, size = {T.Q2_K: (256, 84), T.Q3_K: (256, 110), T.Q4_K: (256, 144), T.Q5_K: (256, 176),
                     T.Q6_K: (256, 210), T.IQ4_NL: (32, 18), T.IQ4_XS: (256, 136),
                     T.IQ3_XXS: (256, 98)}[qtype]  # fmt: skip
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // weights, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, size=(n * k // weights, 2)).astype(np.float16).view(np.uint8)
    if qtype in (T.Q6_K, T.Q3_K):
        blocks[:, size - 2 : size] = scales[:, 0:2]  # d comes last
    elif qtype is T.Q2_K:
        blocks[:, size - 4 : size] = scales  # d, dmin last
    elif qtype in (T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS):
        blocks[:, 0:2] = scales[:, 0:2]  # d first
    else:
        blocks[:, 0:4] = scales  # d, dmin
    return blocks.reshape(n, -1)


def _reference(raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k).copy())


@pytest.mark.parametrize("kind", [QuantKind.Q4_K, QuantKind.Q5_K, QuantKind.Q6_K, QuantKind.Q2_K])
def test_the_k_quant_encoders_write_what_gguf_reads_back(kind: QuantKind) -> None:
    """``quantize_k4`` / ``quantize_q6_k`` / ``quantize_q2_k`` (``--weights q4_k | q5_k | q6_k | q2_k``; gguf's Python
    package reads the K-quants but cannot write them): gguf dequantises their blocks to within a step of the source."""
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = _reference(quantize_blocks(x, kind), T(int(kind)), 8, 512).numpy()
    levels = {QuantKind.Q4_K: 15, QuantKind.Q5_K: 31, QuantKind.Q6_K: 63, QuantKind.Q2_K: 3}[kind]
    assert np.abs(back - x).max() < 0.05 * 8 / levels  # within one step of a +-4 sigma range


@pytest.mark.parametrize("qtype", [T.IQ3_XXS])
def test_other_formats_become_q8_0_within_half_a_new_step(qtype: GGMLQuantizationType) -> None:
    n, k = 16, 512
    raw = _random_k_blocks(qtype, n, k, seed=3)
    assert converts(qtype) and target(qtype) is QuantKind.Q8_0
    report = QuantReport()
    p = convert(qtype, raw, (n, k), report)
    want = _reference(raw, qtype, n, k)
    step = want.reshape(n, k // 32, 32).abs().amax(dim=2, keepdim=True) / 127  # Q8_0's block step
    err = (p.dequantize() - want).reshape(n, k // 32, 32).abs()
    # half a step of the fp16 scale (itself within 2^-11 of the step), plus that rounding times up to 127 quants
    assert (err <= step * (0.5 * (1 + 2.0**-11) + 127 * 2.0**-11) + 1e-12).all()
    assert 0 < report.relative_rms(f"{qtype.name}->Q8_0") < 0.01


def test_q3_k_converts_exactly_into_q6_k() -> None:
    """Q3_K's values (-4..3 times a signed 6-bit scale per 16 times the fp16 ``d``) are Q6_K values (the quants + 32,
    the scales as int8, the same ``d``): the form a fused group mixing Q3_K with Q6_K takes (as every Q3_K tensor was
    built before Q3_K was kept), bit-equal to gguf's dequantisation of the source, for any bit pattern."""
    from builders.gguf_convert import _as
    from torch_engine.gguf_blocks import from_gguf_blocks

    n, k = 24, 768
    raw = _random_k_blocks(T.Q3_K, n, k, seed=5)
    assert not converts(T.Q3_K)
    p = _as(from_gguf_blocks(QuantKind.Q3_K, raw, (n, k)), QuantKind.Q6_K)
    assert p.kind is QuantKind.Q6_K and p.nbytes == n * k * 6.5625 / 8
    assert torch.equal(p.dequantize(), _reference(raw, T.Q3_K, n, k))


def test_iq4_xs_becomes_iq4_nl_within_its_scales_fp16_rounding() -> None:
    """IQ4_XS: the same indices into the same table; each block's scale ``d * (scale - 32)`` (fp32) rounds to IQ4_NL's
    fp16 scale: each weight within 2^-11 of itself (4.5 bits a weight), far closer than requantizing it into Q8_0 (8.5
    bits) would come."""
    n, k = 16, 512
    raw = _random_k_blocks(T.IQ4_XS, n, k, seed=6)
    assert converts(T.IQ4_XS) and target(T.IQ4_XS) is QuantKind.IQ4_NL
    report = QuantReport()
    p = convert(T.IQ4_XS, raw, (n, k), report)
    want = _reference(raw, T.IQ4_XS, n, k)
    assert p.kind is QuantKind.IQ4_NL and p.nbytes == n * k * 4.5 / 8
    assert ((p.dequantize() - want).abs() <= want.abs() * 2.0**-11).all()
    requantized = QuantReport()
    requantized.add("q8_0", want, quantize_tensor(want, QuantKind.Q8_0))
    assert 0 < report.relative_rms("IQ4_XS->IQ4_NL") < requantized.relative_rms("q8_0") / 4


def test_an_iq4_xs_scale_fp16_cannot_hold_is_a_build_error_naming_the_tensor() -> None:
    """``d * (scale - 32)`` past fp16's range (a large ``d``: not seen in real files) fits no fp16-scaled block format
    (IQ4_NL's scale would be inf, Q8_0's too): the import fails naming the tensor, the cause and ``--weights fp32``."""
    from builders.errors import BuildError
    from builders.gguf_file import GGUFTensor
    from builders.gguf_import import _tensor

    n, k = 4, 256
    raw = _random_k_blocks(T.IQ4_XS, n, k, seed=8).reshape(n, 1, 136).copy()
    raw[:, :, 0:2] = np.full((n, 1, 1), 30000, dtype=np.float16).view(np.uint8)  # d 30000: d * 31 > 65504
    raw[:, :, 2:8] = 0xFF  # every 6-bit scale 63: 31 after the offset
    t = GGUFTensor(name="blk.0.ffn_down.weight", tensor_type=T.IQ4_XS, shape=(k, n), data=raw.reshape(n, 136))
    with pytest.raises(BuildError, match=r"blk\.0\.ffn_down\.weight.*fp16's range.*--weights fp32"):
        _tensor(Path("x.gguf"), t, True, QuantReport())


def test_dense_and_kept_formats_are_not_converted() -> None:
    kept = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q6_K, T.Q5_K, T.Q5_1, T.Q5_0, T.Q4_K, T.Q4_1, T.Q4_0, T.IQ4_NL, T.Q3_K,
            T.Q2_K)  # fmt: skip
    assert not any(converts(t) for t in kept)


@pytest.mark.parametrize(
    ("qtype", "bits"),
    [(T.Q4_K, 4.625), (T.Q5_K, 5.625), (T.Q6_K, 6.5625), (T.IQ4_NL, 4.5), (T.Q3_K, 3.5625), (T.Q2_K, 2.625)],
)
def test_the_k_quants_and_iq4_nl_are_kept_as_stored(qtype: GGMLQuantizationType, bits: float) -> None:
    """Any Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL bit pattern (random blocks: every quant, every scale and minimum,
    Q6_K's int8 scales down to -128) imports as stored, at the file's bits a weight (Q3_K / Q4_K / Q5_K: their 6-bit
    scales and minimums a byte each, 0.125 bits a weight more), and dequantises bit-equal to gguf."""
    from builders.gguf_file import GGUFTensor
    from builders.gguf_import import _tensor

    n, k = 24, 768
    raw = _random_k_blocks(qtype, n, k, seed=4)
    t = GGUFTensor(name="blk.0.ffn_down.weight", tensor_type=qtype, shape=(k, n), data=raw)
    report = QuantReport()
    p = _tensor(Path("x.gguf"), t, True, report)
    assert isinstance(p, Packed) and p.kind is QuantKind(int(qtype)) and p.nbytes == n * k * bits / 8
    assert torch.equal(p.dequantize(), _reference(raw, qtype, n, k)) and not report.tensors


def test_a_format_gguf_cannot_dequantise_is_a_build_error_naming_it(tmp_path: Path) -> None:
    """Q8_K (llama.cpp's intermediate format; gguf's Python package has no dequantisation for it) in a file:
    the import fails with a BuildError naming the tensor and its type, packed or dense."""
    from builders.errors import BuildError
    from builders.gguf_file import GGUFTensor
    from builders.gguf_import import _tensor

    t = GGUFTensor(name="blk.0.ffn_down.weight", tensor_type=T.Q8_K, shape=(256, 4),
                        data=np.zeros((4, 292), dtype=np.uint8))  # fmt: skip
    for packed in (True, False):
        with pytest.raises(BuildError, match=r"blk\.0\.ffn_down\.weight \(Q8_K\)"):
            _tensor(tmp_path / "x.gguf", t, packed, QuantReport())


_DOWN = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.IQ4_NL, T.Q2_K)  # FFN-down's format in layer l: _DOWN[l % 6]


def _rewrite_as_k_quants(src: Path, dst: Path) -> None:
    """The embedded file with its FFN-down weights (1536 columns) in Q4_K, Q5_K, Q6_K, Q3_K, IQ4_NL and Q2_K (by layer,
    ``_DOWN``; llama.cpp's encodings, by ``quantize_blocks``), its q, k, v (576 columns, not
    a multiple of 256) in Q5_0 and its gate, up in Q5_1; everything else as it was (Q4_1, the embedding Q8_0)."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        ends = ("ffn_down.weight", "_q.weight", "_k.weight", "_v.weight", "ffn_gate.weight", "ffn_up.weight")
        if not (t.name.startswith("blk.") and t.name.endswith(ends)):
            return None
        shape = [int(v) for v in reversed(t.shape)]  # [N, K]
        dense = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("ffn_down.weight"):
            qtype = _DOWN[int(t.name.split(".")[1]) % len(_DOWN)]
            return quantize_blocks(dense, QuantKind(int(qtype))), qtype
        kind = QuantKind.Q5_1 if t.name.endswith(("ffn_gate.weight", "ffn_up.weight")) else QuantKind.Q5_0
        return quantize_blocks(dense, kind), T(int(kind))

    rewrite(src, dst, convert)


def test_the_q3_k_and_iq4_nl_encoders_write_what_gguf_reads_back() -> None:
    """``quantize_q3_k`` and ``quantize_iq4_nl`` (``--weights q3_k`` / ``iq4_nl``): gguf dequantises them to within
    a step of the source."""
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32) * 0.05
    q3, iq4 = quantize_blocks(x, QuantKind.Q3_K), quantize_blocks(x, QuantKind.IQ4_NL)
    for blocks, qtype, step in ((q3, T.Q3_K, 0.05 * 8 / 7), (iq4, T.IQ4_NL, 0.05 * 8 / 10)):
        back = _reference(blocks, qtype, 8, 512).numpy()
        assert np.abs(back - x).max() < step, qtype
        assert np.abs(back - x).mean() < step / 4, qtype


def _weights(seed: int, k: int) -> Callable[[QuantKind], Packed]:
    """A maker of random ``[32, k]`` weights quantized to a given format."""
    from builders.quantize import quantize_tensor

    rng = np.random.default_rng(seed)
    return lambda kind: quantize_tensor(torch.from_numpy(rng.standard_normal((32, k)).astype(np.float32)), kind)


def _fused(tensors: dict[str, Weight], converted: dict[str, float] | None = None) -> Checkpoint:
    """``same_format_for_fused`` over a checkpoint of ``tensors`` (and the import's ``converted`` errors)."""
    from builders.gguf_convert import same_format_for_fused
    from torch_engine.config import Family, ModelConfig

    cfg = ModelConfig(family=Family.LLAMA, vocab_size=8, hidden_size=64, intermediate_size=32, num_layers=4,
                      num_heads=1, num_kv_heads=1, head_dim=64)  # fmt: skip
    return same_format_for_fused(Checkpoint(cfg, dict(tensors), lambda _: False, "t", converted or {}))


def test_weights_fused_together_are_brought_to_one_format() -> None:
    """q, k, v (and gate, up) are stacked into one GEMM, so they must share a format: the smallest one every member
    converts into exactly (Q4_0 -> Q4_1 / Q5_0 / Q5_1 / Q8_0, Q4_1 -> Q5_1, Q5_0 -> Q5_1 / Q8_0), else the finest
    among them (Q4_1 / Q5_1 -> Q8_0 requantized with its error recorded); a group mixing dense and packed weights
    is dequantised; groups already in one format are left alone."""
    w = _weights(seed=5, k=64)

    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    b, c = "model.layers.1.self_attn.", "model.layers.1.mlp."
    e, f = "model.layers.2.self_attn.", "model.layers.2.mlp."
    g, h = "model.layers.3.self_attn.", "model.layers.3.mlp."
    tensors: dict[str, Weight] = {
        a + "q_proj.weight": w(QuantKind.Q4_0), a + "k_proj.weight": w(QuantKind.Q4_1),
        a + "v_proj.weight": w(QuantKind.Q4_0),
        m + "gate_proj.weight": w(QuantKind.Q4_1), m + "up_proj.weight": w(QuantKind.Q8_0),
        b + "q_proj.weight": w(QuantKind.Q8_0), b + "k_proj.weight": torch.ones(32, 64),
        b + "v_proj.weight": w(QuantKind.Q8_0),
        c + "gate_proj.weight": w(QuantKind.Q4_0), c + "up_proj.weight": w(QuantKind.Q4_0),
        e + "q_proj.weight": w(QuantKind.Q5_0), e + "k_proj.weight": w(QuantKind.Q5_0),
        e + "v_proj.weight": w(QuantKind.Q8_0),
        f + "gate_proj.weight": w(QuantKind.Q4_0), f + "up_proj.weight": w(QuantKind.Q5_0),
        g + "q_proj.weight": w(QuantKind.Q4_1), g + "k_proj.weight": w(QuantKind.Q5_0),
        g + "v_proj.weight": w(QuantKind.Q4_0),
        h + "gate_proj.weight": w(QuantKind.Q5_1), h + "up_proj.weight": w(QuantKind.Q8_0),
    }  # fmt: skip
    out = _fused(tensors, {"Q3_K->Q8_0": 1e-4})
    kinds = {n: (v.kind if isinstance(v, Packed) else None) for n, v in out.tensors.items()}
    assert kinds[a + "q_proj.weight"] is kinds[a + "v_proj.weight"] is kinds[a + "k_proj.weight"] is QuantKind.Q4_1
    assert kinds[m + "gate_proj.weight"] is kinds[m + "up_proj.weight"] is QuantKind.Q8_0
    assert kinds[b + "q_proj.weight"] is kinds[b + "k_proj.weight"] is kinds[b + "v_proj.weight"] is None
    assert out.tensors[c + "gate_proj.weight"] is tensors[c + "gate_proj.weight"]  # one format already
    assert kinds[e + "q_proj.weight"] is kinds[e + "k_proj.weight"] is kinds[e + "v_proj.weight"] is QuantKind.Q8_0
    assert kinds[f + "gate_proj.weight"] is kinds[f + "up_proj.weight"] is QuantKind.Q5_0
    assert kinds[g + "q_proj.weight"] is kinds[g + "k_proj.weight"] is kinds[g + "v_proj.weight"] is QuantKind.Q5_1
    assert kinds[h + "gate_proj.weight"] is kinds[h + "up_proj.weight"] is QuantKind.Q8_0
    exact = (a + "q_proj.weight", a + "v_proj.weight", b + "q_proj.weight", e + "q_proj.weight", f + "gate_proj.weight",
             g + "q_proj.weight", g + "k_proj.weight", g + "v_proj.weight")  # fmt: skip
    for name in exact:
        before, after = tensors[name], out.tensors[name]
        assert isinstance(before, Packed)
        assert torch.equal(after.dequantize() if isinstance(after, Packed) else after, before.dequantize())
    assert out.converted["Q4_0->Q4_1"] == out.converted["Q5_0->Q8_0"] == out.converted["Q4_0->Q5_0"] == 0.0
    assert out.converted["Q4_1->Q5_1"] == out.converted["Q5_0->Q5_1"] == out.converted["Q4_0->Q5_1"] == 0.0
    assert 0 < out.converted["Q4_1->Q8_0"] < 0.01 and 0 < out.converted["Q5_1->Q8_0"] < 0.01
    assert out.converted["Q3_K->Q8_0"] == 1e-4  # the import's conversions carried


def test_fused_groups_with_k_quants() -> None:
    """The K-quants' two-level scales have no exact counterpart but Q4_K -> Q5_K (the 5th bits 0) and Q3_K -> Q6_K (the
    quants + 28): Q4_K_M's attn_v in Q6_K beside q / k in Q4_K becomes Q8_0, each member requantized with its error
    recorded; Q4_K beside Q5_K becomes Q5_K exactly, Q3_K beside Q6_K Q6_K exactly; a group all in Q6_K stays."""
    w = _weights(seed=6, k=256)

    a, m, b, c = "model.layers.0.self_attn.", "model.layers.0.mlp.", "model.layers.1.mlp.", "model.layers.2.mlp."
    tensors: dict[str, Weight] = {
        a + "q_proj.weight": w(QuantKind.Q4_K), a + "k_proj.weight": w(QuantKind.Q4_K),
        a + "v_proj.weight": w(QuantKind.Q6_K),
        m + "gate_proj.weight": w(QuantKind.Q6_K), m + "up_proj.weight": w(QuantKind.Q6_K),
        b + "gate_proj.weight": w(QuantKind.Q4_K), b + "up_proj.weight": w(QuantKind.Q5_K),
        c + "gate_proj.weight": w(QuantKind.Q3_K), c + "up_proj.weight": w(QuantKind.Q6_K),
    }  # fmt: skip
    out = _fused(tensors)
    kinds = {n: (v.kind if isinstance(v, Packed) else None) for n, v in out.tensors.items()}
    assert {kinds[a + p] for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")} == {QuantKind.Q8_0}
    assert out.tensors[m + "gate_proj.weight"] is tensors[m + "gate_proj.weight"]
    assert kinds[b + "gate_proj.weight"] is kinds[b + "up_proj.weight"] is QuantKind.Q5_K
    before, after = tensors[b + "gate_proj.weight"], out.tensors[b + "gate_proj.weight"]
    assert isinstance(before, Packed) and isinstance(after, Packed)
    assert torch.equal(after.dequantize(), before.dequantize()) and out.converted["Q4_K->Q5_K"] == 0.0
    assert 0 < out.converted["Q6_K->Q8_0"] < 0.01 and 0 < out.converted["Q4_K->Q8_0"] < 0.01
    assert kinds[c + "gate_proj.weight"] is kinds[c + "up_proj.weight"] is QuantKind.Q6_K
    before, after = tensors[c + "gate_proj.weight"], out.tensors[c + "gate_proj.weight"]
    assert isinstance(before, Packed) and isinstance(after, Packed) and before.kind is QuantKind.Q3_K
    assert torch.equal(after.dequantize(), before.dequantize()) and out.converted["Q3_K->Q6_K"] == 0.0


def test_fused_groups_with_iq4_nl() -> None:
    """IQ4_NL converts exactly into Q8_0 only (its table's values, the same scale): beside Q8_0 or Q5_0 (llama.cpp's
    IQ4_XS mixes keep attn_v finer in some layers) a group becomes Q8_0 with nothing lost; beside Q4_1 (no common exact
    format) Q8_0 too, the finest, Q4_1's requantization recorded."""
    w = _weights(seed=7, k=256)

    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    tensors: dict[str, Weight] = {
        a + "q_proj.weight": w(QuantKind.IQ4_NL), a + "k_proj.weight": w(QuantKind.Q5_0),
        a + "v_proj.weight": w(QuantKind.Q8_0),
        m + "gate_proj.weight": w(QuantKind.IQ4_NL), m + "up_proj.weight": w(QuantKind.Q4_1),
    }  # fmt: skip
    out = _fused(tensors)
    for name in tensors:
        after = out.tensors[name]
        assert isinstance(after, Packed) and after.kind is QuantKind.Q8_0, name
    for name in (a + "q_proj.weight", a + "k_proj.weight", m + "gate_proj.weight"):
        before = tensors[name]
        assert isinstance(before, Packed) and torch.equal(out.tensors[name].dequantize(), before.dequantize())
    assert out.converted["IQ4_NL->Q8_0"] == 0.0 and 0 < out.converted["Q4_1->Q8_0"] < 0.01


@pytest.mark.e2e
def test_a_k_quant_file_builds_packed_and_decodes_as_its_dequantised_form(tmp_path: Path) -> None:
    """As stored, the Q4_K, Q5_K, Q6_K, Q3_K, IQ4_NL, Q2_K, Q5_0 and Q5_1 tensors stay; the engine's
    reference
    path on that build gives the same next-token distributions as on the dense build of the same file (gguf's
    dequantisation: the packed weights dequantise bit-equal to it), and the fast path (integer kernels, the
    compiled step) runs on it."""
    src = tmp_path / "smollm2-kq.gguf"
    _rewrite_as_k_quants(smollm2_gguf(), src)
    ck = load_gguf(src)
    kinds = [QuantKind(int(t)) for t in _DOWN]
    for layer in range(6, 12):
        down = ck.tensors[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert isinstance(down, Packed) and down.kind is kinds[layer % len(_DOWN)]
    q = ck.tensors["model.layers.3.self_attn.q_proj.weight"]
    assert isinstance(q, Packed) and q.kind is QuantKind.Q5_0
    up = ck.tensors["model.layers.3.mlp.up_proj.weight"]
    assert isinstance(up, Packed) and up.kind is QuantKind.Q5_1
    assert ck.converted == {}  # nothing converted

    stored = build_engine(str(src), tmp_path / "as-stored", BuildOptions(dtype=DType.FLOAT32), progress=False)
    dense_opts = BuildOptions(dtype=DType.FLOAT32, weights=WeightStorage.DENSE)
    dense = build_engine(str(src), tmp_path / "dense", dense_opts, progress=False)
    manifest = EngineManifest.load(stored)
    assert manifest.weights is WeightStorage.AS_STORED and manifest.conversion_error == ck.converted
    assert (stored / "rank0.safetensors").stat().st_size * 4 < (dense / "rank0.safetensors").stat().st_size
    ref_stored = LLMEngine(EngineConfig(engine_dir=stored, num_pages=64))
    ref_dense = LLMEngine(EngineConfig(engine_dir=dense, num_pages=64))
    tok = ref_dense.tokenizer
    assert tok is not None
    prompts = smollm2_prompts(tok)
    greedy = ref_dense.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, cont in zip(prompts, greedy, strict=True):
        a, b = prompt_logprobs(ref_stored, prompt + cont), prompt_logprobs(ref_dense, prompt + cont)
        diff = [abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)]
        assert max(diff) < 1e-4, diff  # the same fp32 weights
        assert top1_agreement(a, b) == 1.0
    fast = LLMEngine(EngineConfig(engine_dir=stored, num_pages=64, fast_cpu=True), load_tokenizer=False)
    path = fast.kernel_path
    assert "iq4_nl+q2_k+q3_k+q4_1+q4_k+q5_0+q5_1+q5_k+q6_k+q8_0-int8" in path and "fused-step" in path
    assert len(fast.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]) == 8

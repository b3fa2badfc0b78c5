"""A GGUF's K-quants and other formats converted at build time (``builders/gguf_convert.py``).

Reference: gguf's own dequantisation of the source blocks. Q4_K -> Q4_1 keeps the quants and rounds only
each block's scale and minimum to fp16; Q6_K, Q5_0 and Q5_1 are kept as stored; the rest (Q5_K, ...) are
requantized to Q8_0, each weight within half its new block step. End to end: the embedded SmolLM2 file
rewritten with its FFN-down tensors in Q4_K and Q6_K (alternate layers, as llama.cpp's Q4_K_M mixes them), its
q, k, v in Q5_0 (as Q4_K_M does for rows that are not a multiple of 256) and its gate, up in Q5_1 (a Q5_K_M's
fallback) builds packed, and the engine on it decodes as on gguf's dequantisation of the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize, quantize

from bench.gguf_rewrite import rewrite
from bench.quality import prompt_logprobs, top1_agreement
from builders import BuildOptions, build_engine
from builders.embedded import smollm2_gguf
from builders.gguf_convert import convert, converts, target
from builders.gguf_import import load_gguf
from builders.quantize import QuantReport, quantize_q6_k
from tests.helpers import smollm2_prompts
from torch_engine.config import DType, EngineConfig, EngineManifest, WeightStorage
from torch_engine.engine import LLMEngine
from torch_engine.quant import Packed, QuantKind, Weight
from torch_engine.sampling import SamplingParams

T = GGMLQuantizationType


def _q4_k(x: np.ndarray) -> np.ndarray:
    """A plain Q4_K encoder (min / max per 32-weight sub-block, 6-bit scales per 256): ``[N, K]`` fp32 ->
    raw blocks as a GGUF holds them (gguf's Python package can read Q4_K but not write it)."""
    n, k = x.shape
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale, offset = (sub.max(axis=2) - lo) / 15, -lo
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = (offset.max(axis=1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dmin == 0, 1, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32) * sc)[:, :, None]
    shift = (dmin.astype(np.float32) * mn)[:, :, None]
    q = np.clip(np.round((sub + shift) / np.where(step == 0, 1, step)), 0, 15).astype(np.uint8)
    scales = np.zeros((sub.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c + 1
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(n, k // 256 * 144)


def _random_k_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant (every bit pattern is a valid block) with small fp16 super-block scales."""
    size = {T.Q3_K: 110, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, size=(n * k // 256, 2)).astype(np.float16).view(np.uint8)
    if qtype in (T.Q6_K, T.Q3_K):
        blocks[:, size - 2 : size] = scales[:, 0:2]  # d comes last
    else:
        blocks[:, 0:4] = scales  # d, dmin
    return blocks.reshape(n, -1)


def _reference(raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k).copy())


def test_the_test_encoder_writes_q4_k_that_gguf_reads_back() -> None:
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = _reference(_q4_k(x), T.Q4_K, 8, 512).numpy()
    assert np.abs(back - x).max() < 0.05 * 6 / 15  # within a 4-bit step of a +-3 sigma range


@pytest.mark.parametrize("source", ["encoded", "random"])
def test_q4_k_becomes_q4_1_keeping_its_quants(source: str) -> None:
    """Each Q4_K sub-block is a Q4_1 block: equal to gguf's dequantisation but for the fp16 rounding of its
    scale d * sc and minimum dmin * m (each within 2^-11 relatively), so |error| <= (15 |d sc| + |dmin m|) 2^-11."""
    n, k = 32, 768
    if source == "encoded":
        raw = _q4_k(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32) * 0.05)
    else:
        raw = _random_k_blocks(T.Q4_K, n, k, seed=1)
    report = QuantReport()
    p = convert(T.Q4_K, raw, (n, k), report)
    assert p.kind is QuantKind.Q4_1 and p.shape == (n, k) and target(T.Q4_K) is QuantKind.Q4_1
    assert p.nbytes < raw.nbytes * 1.15  # 5 bits a weight against Q4_K's 4.5: no dense copy
    want = _reference(raw, T.Q4_K, n, k)
    assert p.m is not None
    scale, minimum = p.d.float().repeat_interleave(32, dim=1), p.m.float().repeat_interleave(32, dim=1)
    bound = (15 * scale.abs() + minimum.abs()) * 2.0**-11 * 1.001 + 1e-12
    assert ((p.dequantize() - want).abs() <= bound).all()
    assert 0 < report.relative_rms("Q4_K->Q4_1") < 1e-3
    assert "Q4_K->Q4_1: 1 tensors" in report.summary()


@pytest.mark.parametrize("qtype", [T.Q5_K, T.Q3_K])
def test_other_formats_become_q8_0_within_half_a_new_step(qtype: GGMLQuantizationType) -> None:
    n, k = 16, 512
    raw = _random_k_blocks(qtype, n, k, seed=3)
    assert converts(qtype) and target(qtype) is QuantKind.Q8_0
    report = QuantReport()
    p = convert(qtype, raw, (n, k), report)
    want = _reference(raw, qtype, n, k)
    step = want.reshape(n, k // 32, 32).abs().amax(dim=2, keepdim=True) / 127  # Q8_0's block step
    err = (p.dequantize() - want).reshape(n, k // 32, 32).abs()
    assert (err <= step * (0.5 + 127 * 2.0**-11) + 1e-12).all()  # half a step, plus the fp16 scale's rounding
    assert 0 < report.relative_rms(f"{qtype.name}->Q8_0") < 0.01


def test_dense_and_kept_formats_are_not_converted() -> None:
    assert not any(converts(t) for t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q6_K, T.Q5_1, T.Q5_0, T.Q4_1, T.Q4_0))


def test_q6_k_is_kept_as_stored() -> None:
    """Any Q6_K bit pattern (random blocks: every 6-bit quant, int8 scales down to -128) imports as stored, 6.5625
    bits a weight, and dequantises bit-equal to gguf."""
    from types import SimpleNamespace

    from builders.gguf_import import _tensor

    n, k = 24, 768
    raw = _random_k_blocks(T.Q6_K, n, k, seed=4)
    t = SimpleNamespace(name="blk.0.ffn_down.weight", tensor_type=T.Q6_K, shape=[k, n], data=raw)
    report = QuantReport()
    p = _tensor(Path("x.gguf"), t, True, report)
    assert isinstance(p, Packed) and p.kind is QuantKind.Q6_K and p.nbytes == raw.nbytes == n * k * 6.5625 / 8
    assert torch.equal(p.dequantize(), _reference(raw, T.Q6_K, n, k)) and not report.tensors


def test_a_format_gguf_cannot_dequantise_is_a_build_error_naming_it(tmp_path: Path) -> None:
    """Q8_K (llama.cpp's intermediate format; gguf's Python package has no dequantisation for it) in a file:
    the import fails with a BuildError naming the tensor and its type, packed or dense."""
    from types import SimpleNamespace

    from builders.errors import BuildError
    from builders.gguf_import import _tensor

    t = SimpleNamespace(name="blk.0.ffn_down.weight", tensor_type=T.Q8_K, shape=[256, 4],
                        data=np.zeros((4, 292), dtype=np.uint8))  # fmt: skip
    for packed in (True, False):
        with pytest.raises(BuildError, match=r"blk\.0\.ffn_down\.weight \(Q8_K\)"):
            _tensor(tmp_path / "x.gguf", t, packed, QuantReport())


def _rewrite_as_k_quants(src: Path, dst: Path) -> None:
    """The embedded file with its FFN-down weights (1536 columns) in Q4_K in even layers and Q6_K (llama.cpp's
    encoding by the test's ``quantize_q6_k``) in odd ones, its q, k, v (576 columns, not a multiple of 256) in Q5_0
    and its gate, up in Q5_1; everything else as it was (Q4_1, the embedding Q8_0)."""

    def convert(t: ReaderTensor) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        ends = ("ffn_down.weight", "_q.weight", "_k.weight", "_v.weight", "ffn_gate.weight", "ffn_up.weight")
        if not (t.name.startswith("blk.") and t.name.endswith(ends)):
            return None
        shape = [int(v) for v in reversed(t.shape)]  # [N, K]
        dense = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("ffn_down.weight"):
            return (_q4_k(dense), T.Q4_K) if int(t.name.split(".")[1]) % 2 == 0 else (quantize_q6_k(dense), T.Q6_K)
        kind = T.Q5_1 if t.name.endswith(("ffn_gate.weight", "ffn_up.weight")) else T.Q5_0
        return quantize(dense, kind), kind

    rewrite(src, dst, convert)


def test_weights_fused_together_are_brought_to_one_format() -> None:
    """q, k, v (and gate, up) are stacked into one GEMM, so they must share a format: the smallest one every member
    converts into exactly (Q4_0 -> Q4_1 / Q5_0 / Q5_1 / Q8_0, Q4_1 -> Q5_1, Q5_0 -> Q5_1 / Q8_0), else the finest
    among them (Q4_1 / Q5_1 -> Q8_0 requantized with its error recorded); a group mixing dense and packed weights
    is dequantised; groups already in one format are left alone."""
    from builders.checkpoint import Checkpoint
    from builders.gguf_convert import same_format_for_fused
    from builders.quantize import quantize_tensor
    from torch_engine.config import Family, ModelConfig

    rng = np.random.default_rng(5)

    def w(kind: QuantKind) -> Packed:
        return quantize_tensor(torch.from_numpy(rng.standard_normal((32, 64)).astype(np.float32)), kind)

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
    cfg = ModelConfig(family=Family.LLAMA, vocab_size=8, hidden_size=64, intermediate_size=32, num_layers=4,
                      num_heads=1, num_kv_heads=1, head_dim=64)  # fmt: skip
    out = same_format_for_fused(Checkpoint(cfg, dict(tensors), lambda _: False, "t", {"Q4_K->Q4_1": 1e-4}))
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
    assert out.converted["Q4_K->Q4_1"] == 1e-4  # the import's conversions carried


def test_a_fused_group_mixing_q6_k_becomes_q8_0() -> None:
    """Q6_K's two-level scales have no exact counterpart (Q4_K_M's attn_v in Q6_K beside q / k in Q4_K -> Q4_1):
    the group becomes Q8_0, each member requantized with its error recorded; a group all in Q6_K stays."""
    from builders.checkpoint import Checkpoint
    from builders.gguf_convert import same_format_for_fused
    from builders.quantize import quantize_tensor
    from torch_engine.config import Family, ModelConfig

    rng = np.random.default_rng(6)

    def w(kind: QuantKind) -> Packed:
        return quantize_tensor(torch.from_numpy(rng.standard_normal((32, 256)).astype(np.float32)), kind)

    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    tensors: dict[str, Weight] = {
        a + "q_proj.weight": w(QuantKind.Q4_1), a + "k_proj.weight": w(QuantKind.Q4_1),
        a + "v_proj.weight": w(QuantKind.Q6_K),
        m + "gate_proj.weight": w(QuantKind.Q6_K), m + "up_proj.weight": w(QuantKind.Q6_K),
    }  # fmt: skip
    cfg = ModelConfig(family=Family.LLAMA, vocab_size=8, hidden_size=256, intermediate_size=32, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=256)  # fmt: skip
    out = same_format_for_fused(Checkpoint(cfg, dict(tensors), lambda _: False, "t", {}))
    kinds = {n: (v.kind if isinstance(v, Packed) else None) for n, v in out.tensors.items()}
    assert {kinds[a + p] for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")} == {QuantKind.Q8_0}
    assert out.tensors[m + "gate_proj.weight"] is tensors[m + "gate_proj.weight"]
    assert 0 < out.converted["Q6_K->Q8_0"] < 0.01 and 0 < out.converted["Q4_1->Q8_0"] < 0.01


@pytest.mark.e2e
def test_a_k_quant_file_builds_packed_and_decodes_as_its_dequantised_form(tmp_path: Path) -> None:
    """As stored, the Q4_K tensors become Q4_1 (the manifest states the conversion's error), the Q6_K, Q5_0 and Q5_1
    ones stay;
    the engine's reference path on that build gives the same next-token distributions as on the dense build
    of the same file (gguf's dequantisation) within the fp16 rounding of the scales, and the fast path
    (integer kernels, the compiled step) runs on it."""
    src = tmp_path / "smollm2-kq.gguf"
    _rewrite_as_k_quants(smollm2_gguf(), src)
    ck = load_gguf(src)
    down, q = ck.tensors["model.layers.2.mlp.down_proj.weight"], ck.tensors["model.layers.3.self_attn.q_proj.weight"]
    assert isinstance(down, Packed) and down.kind is QuantKind.Q4_1
    odd = ck.tensors["model.layers.3.mlp.down_proj.weight"]
    assert isinstance(odd, Packed) and odd.kind is QuantKind.Q6_K
    assert isinstance(q, Packed) and q.kind is QuantKind.Q5_0
    up = ck.tensors["model.layers.3.mlp.up_proj.weight"]
    assert isinstance(up, Packed) and up.kind is QuantKind.Q5_1
    assert set(ck.converted) == {"Q4_K->Q4_1"} and 0 < ck.converted["Q4_K->Q4_1"] < 1e-3

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
        assert sum(diff) / len(diff) < 0.01 and max(diff) < 0.1, diff  # measured: mean 0.003-0.006, max 0.04
        assert top1_agreement(a, b) >= 0.95
    fast = LLMEngine(EngineConfig(engine_dir=stored, num_pages=64, fast_cpu=True), load_tokenizer=False)
    assert "q4_1+q5_0+q5_1+q6_k+q8_0-int8" in fast.kernel_path and "fused-step" in fast.kernel_path
    assert len(fast.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]) == 8

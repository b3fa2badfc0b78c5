"""Weights kept as the GGUF stores them (``torch_engine/quant.py``, ``csrc/gemm_quant.cpp``).

References: gguf's own dequantisation (bit-equal), a float64 GEMM over the dequantised weight (the
kernel's error no larger than the dense fp32 GEMM's, to within a small factor), the engine's dense
fp32 reference path (the same greedy tokens on the embedded model), and the dense checkpoint's TP
shards (each packed shard dequantises to the dense shard).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from builders import BuildOptions, build_engine
from builders.embedded import smollm2_gguf
from builders.errors import BuildError
from builders.gguf_import import load_gguf
from builders.sharding import shard
from tests.helpers import smollm2_prompts
from torch_engine.config import DType, EngineConfig, EngineManifest, WeightStorage
from torch_engine.engine import LLMEngine
from torch_engine.kernels import cpu_kernels
from torch_engine.layers import Linear
from torch_engine.quant import Packed, QuantKind, cat_rows, from_gguf_blocks, narrow
from torch_engine.sampling import SamplingParams

KINDS = [QuantKind.Q4_0, QuantKind.Q4_1, QuantKind.Q8_0]


def _packed(kind: QuantKind, n: int, k: int, seed: int = 0) -> tuple[Packed, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, GGMLQuantizationType(int(kind)))
    return from_gguf_blocks(kind, raw, (n, k)), raw


@pytest.mark.parametrize("kind", KINDS)
def test_packed_form_dequantises_bit_equal_to_gguf(kind: QuantKind) -> None:
    p, raw = _packed(kind, 48, 96)
    want = np.asarray(dequantize(raw, GGMLQuantizationType(int(kind))), dtype=np.float32)
    assert torch.equal(p.dequantize(), torch.from_numpy(want))
    assert p.shape == (48, 96) and p.nbytes == raw.nbytes


def test_the_shipped_files_tensors_dequantise_bit_equal() -> None:
    reader = GGUFReader(str(smollm2_gguf()))
    seen = set()
    for t in reader.tensors:
        if int(t.tensor_type) in {int(k) for k in QuantKind} and t.tensor_type not in seen:
            seen.add(t.tensor_type)
            p = from_gguf_blocks(QuantKind(int(t.tensor_type)), t.data, (int(t.shape[1]), int(t.shape[0])))
            want = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
            assert torch.equal(p.dequantize(), want), t.name
    assert {s.name for s in seen} == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 40])
def test_gemm_q_matches_the_dequantised_gemm(kind: QuantKind, rows: int) -> None:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no compiler here: the engine dequantises packed weights at load")
    p, _ = _packed(kind, 200, 320, seed=rows)
    lin = Linear(320, 200, bias=True)
    bias = torch.randn(200)
    lin.bias = torch.nn.Parameter(bias, requires_grad=False)
    lin.set_quant(p, torch.float32, kernels)
    assert lin.weight is None
    x = torch.randn(rows, 320)
    w = p.dequantize()
    exact = x.double() @ w.double().T + bias.double()
    dense_err = float((x @ w.T + bias - exact).abs().max())
    err = float((lin(x) - exact).abs().max())
    assert err <= 4 * dense_err + 1e-5, (err, dense_err)
    y16 = lin(x.bfloat16())  # bf16 activations: computed in fp32, returned in bf16
    assert y16.dtype == torch.bfloat16
    assert torch.allclose(y16.float(), exact.float(), atol=0.05, rtol=0.02)
    x3 = x.reshape(1, rows, 320)  # any leading shape
    assert torch.allclose(lin(x3).reshape(rows, 200), lin(x), atol=1e-5)


def test_cuts_follow_blocks_and_fusing_needs_one_kind() -> None:
    p, _ = _packed(QuantKind.Q4_1, 8, 128)
    cut = narrow(p, 1, 32, 64)
    assert isinstance(cut, Packed) and torch.equal(cut.dequantize(), p.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="multiples of 32"):
        narrow(p, 1, 16, 64)
    rows = narrow(p, 0, 2, 3)
    assert isinstance(rows, Packed) and torch.equal(rows.dequantize(), p.dequantize()[2:5])
    q8, _ = _packed(QuantKind.Q8_0, 4, 128)
    with pytest.raises(ValueError, match="stored differently"):
        cat_rows([p, q8])
    both = cat_rows([p, rows])
    assert isinstance(both, Packed) and torch.equal(both.dequantize(), torch.cat([p.dequantize(), p.dequantize()[2:5]]))


@pytest.mark.parametrize("tp", [1, 3])
def test_packed_tp_shards_dequantise_to_the_dense_shards(tp: int) -> None:
    packed, dense = load_gguf(smollm2_gguf()), load_gguf(smollm2_gguf(), packed=False)
    for rank in range(tp):
        a, b = shard(packed, tp, rank), shard(dense, tp, rank)
        assert a.keys() == b.keys()
        kinds = 0
        for name, w in a.items():
            want = b[name]
            assert isinstance(want, torch.Tensor)
            kinds += isinstance(w, Packed)
            assert torch.equal(w.dequantize() if isinstance(w, Packed) else w, want), name
        assert kinds == 1 + 4 * packed.config.num_layers  # the embedding, qkv, o, gate_up, down


def test_a_cut_inside_a_block_is_a_build_error() -> None:
    from builders.sharding import _rows

    p, _ = _packed(QuantKind.Q4_0, 8, 96)
    with pytest.raises(BuildError, match="--weights fp32"):
        _rows(p, 48, 1, dim=1)  # a row-parallel split of 96 columns over 2 ranks: 48 is not whole blocks
    half = _rows(p, 32, 2, dim=1)
    assert isinstance(half, Packed) and torch.equal(half.dequantize(), p.dequantize()[:, 64:96])


def test_as_stored_build_is_smaller_and_says_so(tmp_path: Path) -> None:
    stored = build_engine("smollm2", tmp_path / "q", BuildOptions(dtype=DType.FLOAT32), progress=False)
    dense = BuildOptions(dtype=DType.FLOAT32, weights=WeightStorage.DENSE)
    full = build_engine("smollm2", tmp_path / "d", dense, progress=False)
    assert EngineManifest.load(stored).weights is WeightStorage.AS_STORED
    assert EngineManifest.load(full).weights is WeightStorage.DENSE
    assert (stored / "rank0.safetensors").stat().st_size * 4 < (full / "rank0.safetensors").stat().st_size


def test_as_stored_fast_path_greedy_tokens_equal_the_dense_reference(smollm2_dir: Path) -> None:
    """The engine computing with the packed Q4_1 / Q8_0 weights gives the dense fp32 reference
    path's greedy tokens (3 prompts x 32), and its logits stay within fp32 rounding noise."""
    if cpu_kernels() is None:
        pytest.skip("no compiler here: the engine dequantises packed weights at load")
    assert EngineManifest.load(smollm2_dir).weights is WeightStorage.AS_STORED
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=128))
    assert "gemm-q" not in ref.kernel_path  # the reference dequantised at load
    fast = LLMEngine(EngineConfig(engine_dir=smollm2_dir, num_pages=128, fast_cpu=True))
    assert "q4_1+q8_0-gemm-q" in fast.kernel_path
    assert fast.describe().weight_bytes * 4 < ref.describe().weight_bytes
    tok = ref.tokenizer
    assert tok is not None
    prompts = smollm2_prompts(tok)
    assert fast.generate(prompts, greedy) == ref.generate(prompts, greedy)
    for engine in (ref, fast):
        engine.add_request(prompts[0], SamplingParams(max_tokens=1), want_last_hidden=True, request_id="l")
        while engine.has_unfinished():
            engine.step()
    a, b = ref.request("l").last_logits, fast.request("l").last_logits
    assert a is not None and b is not None
    assert float((a - b).abs().max()) < 2e-3

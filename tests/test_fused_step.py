"""The compiled decode step (``torch_engine/fused_step.py``, ``csrc/decode_step.cpp``) against the eager
model it replaces.

Both paths run the same integer GEMM kernel, so they differ only where they round (the eager model
keeps activations in the engine's dtype and adds in another order) — and through the activations'
int8 quantization, which turns a last-bit difference into a whole quantization step now and then. So
a one-layer model must agree closely, step after step; deeper models within a stated tolerance on
the next-token distribution (KL) and its top token. Everything else must be exact: the progress
counter, K / V in the right page slots (compared on a one-layer model), results independent of the
thread count, and the engine's choice of path (which models, which steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from builders import BuildOptions, build_engine
from tests.helpers import make_tiny_checkpoint
from torch_engine.config import DType, EngineConfig, EngineManifest, KVLayout
from torch_engine.engine import LLMEngine
from torch_engine.fused_step import DENSE_F32_ROWS, why_not_fused
from torch_engine.kernels import cpu_kernels
from torch_engine.kv_cache import PagedKVCache
from torch_engine.layer_progress import LayerProgress
from torch_engine.layers import GatedMLP
from torch_engine.loader import load_weights, prepare_cpu_path
from torch_engine.model_runner import ModelRunner
from torch_engine.models import cache_spec
from torch_engine.models.decoder import DecoderLayer
from torch_engine.parallel import TPGroup
from torch_engine.quant import QuantKind
from torch_engine.sampling import SamplingParams
from torch_engine.steps import Span

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels() -> object:
    k = cpu_kernels()
    if k is None:
        pytest.skip("no compiler here: no compiled decode step")
    return k


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, QuantKind], Path]:
    """Tiny random checkpoints quantized at build time: Llama (head size 8), Qwen2 (q/k/v biases, drawn),
    Qwen3 (q/k norms); one layer and the full two. The K-quants need rows of 256 weights: their checkpoints' MLP is
    256 wide, so the down projection is in the K-quant (the rest falls back to Q8_0, as llama.cpp does)."""
    root = tmp_path_factory.mktemp("fused")
    out: dict[tuple[str, QuantKind], Path] = {}
    for kind in ("llama", "qwen2", "qwen3"):
        folder, _ = make_tiny_checkpoint(kind, root / kind, random_biases=True)
        wide, _ = make_tiny_checkpoint(kind, root / f"{kind}-wide", random_biases=True, intermediate_size=256)
        for q in QuantKind:
            src = wide if q.block_weights > 32 else folder
            opts = BuildOptions(dtype=DType.FLOAT32, page_size=4, quantize=q)
            out[(kind, q)] = build_engine(str(src), root / f"{kind}-{q.name}", opts, progress=False)
    return out


@dataclass
class Pair:
    eager: ModelRunner
    fused: ModelRunner
    pages: int


def _runner(
    engine_dir: Path, fused: bool, layout: KVLayout, page_size: int, layers: int | None = None,
    dtype: torch.dtype = torch.float32, pages: torch.dtype | None = None, torch_ops: bool = False,
) -> ModelRunner:  # fmt: skip
    """pages: the KV pages' dtype (None: ``dtype``); torch_ops: the attention and the KV writes on PyTorch's ops
    (no compiled kernels on the cache)."""
    manifest = EngineManifest.load(engine_dir)
    cfg = EngineConfig(engine_dir=engine_dir, fast_cpu=True, dtype=DType.FLOAT32)
    model = load_weights(manifest, cfg, TPGroup.single(), CPU, dtype, keep_packed=True)
    prepare_cpu_path(model, CPU, dtype)
    if layers is not None:
        model.layers = model.layers[:layers]
    spec = cache_spec(manifest.model, 1, 256, page_size, layout, pages or dtype)
    kv = PagedKVCache(spec, compute_dtype=dtype)
    kv.kernels = None if torch_ops else cpu_kernels()
    runner = ModelRunner(model, kv, LayerProgress(manifest.model.num_kv_layers), TPGroup.single(), CPU, 512)
    if fused:
        runner.use_fused_step(True)
    return runner


def _pair(
    engine_dir: Path, layout: KVLayout = KVLayout.HND, page_size: int = 4, layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Pair:  # fmt: skip
    return Pair(
        _runner(engine_dir, False, layout, page_size, layers, dtype),
        _runner(engine_dir, True, layout, page_size, layers, dtype),
        256,
    )


def _teacher_forced(
    p: Pair, lengths: list[int], steps: int, vocab: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill sequences of ``lengths`` (random tokens) on both runners, then ``steps`` decode steps fed
    the same tokens; the two runners' logits of every decode step."""
    g = torch.Generator().manual_seed(seed)
    per = p.pages // len(lengths)
    pages = [list(range(i * per, (i + 1) * per)) for i in range(len(lengths))]
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    for r in (p.eager, p.fused):
        r.execute(r.layout([Span(s, 0, pg, 1) for s, pg in zip(seqs, pages, strict=True)]))
    out = []
    for _ in range(steps):
        nxt = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
        spans = [Span([t], len(s), pg, 1) for s, t, pg in zip(seqs, nxt, pages, strict=True)]
        logits = [r.logits(r.execute(r.layout(spans))) for r in (p.eager, p.fused)]
        out.append((logits[0], logits[1]))
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
    return out


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    pa, pb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    return (pa.exp() * (pa - pb)).sum(-1)


def _assert_distributions_agree(p: Pair, lengths: list[int], steps: int) -> None:
    """The whole model's next-token distributions, teacher-forced: mean KL < 1e-3, max < 1e-2, the top
    token the same at >= 90 % of the rows."""
    kls, agree, n = [], 0, 0
    for eager, fused in _teacher_forced(p, lengths, steps, 256):
        kls.append(_kl(eager, fused))
        agree += int((eager.argmax(-1) == fused.argmax(-1)).sum())
        n += eager.shape[0]
    kl = torch.cat(kls)
    assert float(kl.mean()) < 1e-3 and float(kl.max()) < 1e-2, (float(kl.mean()), float(kl.max()))
    assert agree / n >= 0.9


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant", list(QuantKind))
def test_one_layer_matches_the_eager_layer(kernels: object, quantized: dict, kind: str, quant: QuantKind) -> None:
    """One layer, 5 sequences (prompts across page boundaries), 10 teacher-forced steps: the logits of at least
    95 % of the rows agree to 2 % of their spread and every row's to 10 %, and the K / V the fused step wrote agree
    too. (Qwen3's q / k norms can differ by an ulp between the compiled step and PyTorch's ops on some CPUs — the
    AVX2-only Zen 3 of 2026-12-07: K 2.4e-7 apart — and an ulp can flip one activation's int8 rounding at the next
    integer GEMM: one row of 50 then moves 2-4 % of the spread there; every other row equal bit for bit.)"""
    p = _pair(quantized[(kind, quant)], layers=1)
    if quant.block_weights > 32:  # a K-quant: the wide MLP's down projection (the rest falls back to Q8_0)
        layer = p.fused.model.layers[0]
        assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, GatedMLP)
        assert layer.mlp.down.quant is not None and layer.mlp.down.quant.kind is quant
    rows = []
    for eager, fused in _teacher_forced(p, [1, 3, 4, 9, 17], 10, 256):
        rows.append((eager - fused).abs().amax(-1) / float(eager.std()))
    off = torch.cat(rows)
    assert float(off.max()) < 0.1 and float((off < 0.02).float().mean()) >= 0.95, off.tolist()
    for a, b in zip(p.eager.kv.pools[:1], p.fused.kv.pools[:1], strict=True):
        assert float((a - b).abs().max()) < 0.02 * float(a.abs().max())
    assert p.fused.fused is not None and p.fused.fused.steps == 10


@pytest.mark.parametrize("layout", [KVLayout.HND, KVLayout.NHD])
@pytest.mark.parametrize("page_size", [4, 16])
def test_whole_model_next_token_distributions_agree(
    kernels: object, quantized: dict, layout: KVLayout, page_size: int
) -> None:
    p = _pair(quantized[("qwen2", QuantKind.Q4_1)], layout, page_size)
    _assert_distributions_agree(p, [2, 5, 16, 31, 7, 1, 12, 3], 12)


def test_progress_counter_moves_once_per_layer_per_step(kernels: object, quantized: dict) -> None:
    p = _pair(quantized[("llama", QuantKind.Q8_0)])
    _teacher_forced(p, [3, 6], 4, 256)
    assert p.eager.progress.snapshot() == p.fused.progress.snapshot() == [5, 5]  # one prefill + 4 decode steps


def test_threads_do_not_change_the_result(kernels: object, quantized: dict) -> None:
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            p = _pair(quantized[("qwen3", QuantKind.Q4_0)])
            results.append(torch.cat([f for _, f in _teacher_forced(p, [4, 9, 2, 30, 5], 5, 256)]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_long_sequences_in_parts_on_bf16_pages(kernels: object, quantized: dict) -> None:
    """bf16 pages and 32-value heads (Qwen3's tiny config): the attention's split path, each row's query
    prepared once for all its parts, sequences of 1 to 30 chunks (parts of 2 and 3 chunks, a short last
    part): the eager model's distributions (its attention takes each sequence whole), and the same result
    at 1, 2 and 3 threads."""
    lengths = [5, 40, 130, 300, 470]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            p = _pair(quantized[("qwen3", QuantKind.Q4_1)], page_size=16, dtype=torch.bfloat16)
            if n == 1:
                _assert_distributions_agree(p, list(lengths), 4)
                p = _pair(quantized[("qwen3", QuantKind.Q4_1)], page_size=16, dtype=torch.bfloat16)
            results.append(torch.cat([f for _, f in _teacher_forced(p, list(lengths), 3, 256)]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_an_fp32_model_on_bf16_pages_follows_torch_ops(kernels: object, quantized: dict, kind: str) -> None:
    """An fp32 model over bf16 pages (``EngineConfig.kv_dtype``): the fused step (its KV write rounds to bf16, its
    attention reads the bf16 pages) against the eager model on PyTorch's ops (``write_kv`` rounding, gathers
    upcast): one layer close step after step, the K / V it wrote within the activations' rounding; the whole model's
    distributions as the fp32 pages' test holds them."""
    path = quantized[(kind, QuantKind.Q4_1)]

    def pair(layers: int | None) -> Pair:
        bf16 = torch.bfloat16
        return Pair(_runner(path, False, KVLayout.HND, 4, layers, pages=bf16, torch_ops=True),
                    _runner(path, True, KVLayout.HND, 4, layers, pages=bf16), 256)  # fmt: skip

    p = pair(1)
    assert p.fused.kv.pools[0].dtype == torch.bfloat16 and p.fused.fused is not None
    for eager, fused in _teacher_forced(p, [1, 3, 4, 9, 17], 10, 256):
        assert fused.dtype == torch.float32 and float((eager - fused).abs().max()) < 0.02 * float(eager.std())
    a, b = p.eager.kv.pools[0].float(), p.fused.kv.pools[0].float()
    assert float((a - b).abs().max()) < 0.02 * float(a.abs().max())
    _assert_distributions_agree(pair(None), [2, 5, 16, 31, 7, 1, 12, 3], 8)


def test_an_engine_on_bf16_pages(kernels: object, quantized: dict) -> None:
    """``kv_dtype: bfloat16`` under an fp32 engine: half the KV bytes a token, its own prefix-cache identity (its
    pages hold other values than fp32 ones), the fused step on the bf16 pages, and greedy tokens (continuous
    batching: prefill and mixed steps on the eager model) equal the eager engine's on the same pages."""
    path = quantized[("qwen3", QuantKind.Q8_0)]
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)

    def engine(**kw: object) -> LLMEngine:
        cfg = {"engine_dir": path, "fast_cpu": True, "dtype": "float32", "num_pages": 64, **kw}
        return LLMEngine(EngineConfig.model_validate(cfg))

    fp32 = engine().describe()
    outs = []
    for fused in (False, True):
        e = engine(kv_dtype="bfloat16", fused_decode=fused)
        info = e.describe()
        assert info.dtype == torch.float32 and info.kv_dtype == torch.bfloat16 and fp32.kv_dtype == torch.float32
        assert 2 * info.kv_bytes_per_token == fp32.kv_bytes_per_token
        assert info.cache_identity != fp32.cache_identity and "kv-torch.bfloat16" in info.cache_identity
        assert ("fused-step" in info.kernel_path) is fused
        outs.append(e.generate(prompts, greedy))
    same = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert same >= 5, outs


def test_many_rows_take_every_tile_size(kernels: object, quantized: dict) -> None:
    """29 rows in a step: a 16-row tile of the GEMM and a 13-row one (on AVX-512). Past 16 rows the
    eager model's GEMMs run on the dequantised weight (no activation rounding) while the fused step
    stays on the integer kernel, so the tolerance is the activations' rounding, as in the whole-model
    test."""
    p = _pair(quantized[("llama", QuantKind.Q4_1)], layers=1)
    for eager, fused in _teacher_forced(p, [1 + (i * 7) % 13 for i in range(29)], 3, 256):
        assert float((eager - fused).abs().max()) < 0.08 * float(eager.std())
        kl = _kl(eager, fused)
        assert float(kl.max()) < 1e-2 and bool((eager.argmax(-1) == fused.argmax(-1)).float().mean() >= 0.9)


def test_the_engine_picks_the_fused_step_where_it_applies(
    kernels: object, quantized: dict, tiny_engine_dir, smollm2_dir: Path
) -> None:
    def engine(path: Path, **kw: object) -> LLMEngine:
        return LLMEngine(EngineConfig.model_validate({"engine_dir": path, "fast_cpu": True, "num_pages": 64, **kw}))

    assert "fused-step" in engine(quantized[("qwen3", QuantKind.Q8_0)]).kernel_path
    assert "fused-step" in engine(smollm2_dir).kernel_path  # the embedded GGUF, as stored
    dense = tiny_engine_dir("llama")  # dense weights in fp32: the fused step up to DENSE_F32_ROWS rows
    assert "fused-step" in engine(dense, dtype="float32").kernel_path
    with pytest.raises(ValueError, match="MLA"):  # a model it cannot run, required: a clear error
        engine(tiny_engine_dir("deepseek_v3"), dtype="float32", fused_decode=True)
    if kernels.gemm_bf16_supported():  # type: ignore[attr-defined]
        assert "fused-step" in engine(dense, dtype="bfloat16").kernel_path  # dense bf16: where the CPU has the dot
    assert "fused-step" not in engine(quantized[("qwen3", QuantKind.Q8_0)], fused_decode=False).kernel_path
    assert "fused-step" not in engine(smollm2_dir, fast_cpu=False).kernel_path  # the reference path


def _mlp(r: ModelRunner, i: int) -> GatedMLP:
    layer = r.model.layers[i]
    assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, GatedMLP)
    return layer.mlp


def test_packed_gemms_of_different_quant_kinds_run_fused(
    kernels: object, quantized: dict, dense32: dict[str, Path]
) -> None:
    """A GGUF mixes quant kinds (a Q4_K_M file becomes Q4_1 and Q8_0): packed weights of any kinds go
    together; packed beside dense does not."""
    a = _runner(quantized[("llama", QuantKind.Q4_1)], False, KVLayout.HND, 4)
    b = _runner(quantized[("llama", QuantKind.Q8_0)], False, KVLayout.HND, 4)
    _mlp(a, 0).down = _mlp(b, 0).down
    assert why_not_fused(a.model, a.kv, TPGroup.single(), CPU) is None
    a.use_fused_step(True)
    assert a.fused is not None
    c = _runner(dense32["llama"], False, KVLayout.HND, 4)
    _mlp(a, 1).down = _mlp(c, 1).down
    assert "more than one way" in str(why_not_fused(a.model, a.kv, TPGroup.single(), CPU))


def test_engine_tokens_follow_the_eager_engine(kernels: object, quantized: dict) -> None:
    """Through the engine (continuous batching: prompts join while others decode, so steps switch between
    the mixed eager path and the fused one): greedy tokens of a Q8_0 model equal the eager engine's."""
    path = quantized[("llama", QuantKind.Q8_0)]
    prompts = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = []
    for fused in (False, True):
        e = LLMEngine(EngineConfig(engine_dir=path, fast_cpu=True, dtype=DType.FLOAT32, fused_decode=fused))
        outs.append(e.generate(prompts, greedy))
    same = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert same >= 5, outs


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory, kernels: object) -> dict[str, Path]:
    """Tiny random checkpoints built dense (an HF checkpoint's way), for the bf16 engine: its GEMMs take
    the weights packed for ``vdpbf16ps``, which needs AVX-512 BF16."""
    if not kernels.gemm_bf16_supported():  # type: ignore[attr-defined]
        pytest.skip("no AVX-512 BF16 here: dense weights stay on the eager model")
    return _dense_engines(tmp_path_factory.mktemp("fused-dense"))


def _dense_engines(root: Path) -> dict[str, Path]:
    """Tiny random checkpoints (drawn biases) of each kind, built dense."""
    out: dict[str, Path] = {}
    for kind in ("llama", "qwen2", "qwen3"):
        folder, _ = make_tiny_checkpoint(kind, root / kind, random_biases=True)
        out[kind] = build_engine(str(folder), root / f"{kind}-e", BuildOptions(dtype=DType.FLOAT32, page_size=4),
                                 progress=False)  # fmt: skip
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_dense_bf16_layer_matches_the_eager_layer(dense: dict[str, Path], kind: str) -> None:
    """Dense bf16 weights (the fused step's ``vdpbf16ps`` GEMM, the eager model's ``gemm_bf16``): one layer,
    5 sequences, 10 teacher-forced steps — the logits agree within bf16's rounding of the activations
    (the eager model rounds every op's output to bf16, the fused step keeps fp32 between GEMMs)."""
    p = _pair(dense[kind], layers=1, dtype=torch.bfloat16)
    for eager, fused in _teacher_forced(p, [1, 3, 4, 9, 17], 10, 256):
        assert float((eager - fused).abs().max()) < 0.08 * float(eager.std())
    for a, b in zip(p.eager.kv.pools[:1], p.fused.kv.pools[:1], strict=True):
        assert float((a.float() - b.float()).abs().max()) < 0.02 * float(a.float().abs().max())
    assert p.fused.fused is not None and p.fused.fused.steps == 10


def test_dense_bf16_whole_model_distributions_agree(dense: dict[str, Path]) -> None:
    """Every layer, 21 rows (the GEMM's 8-row passes and a remainder), 8 steps: KL and top token."""
    p = _pair(dense["qwen2"], dtype=torch.bfloat16)
    _assert_distributions_agree(p, [1 + (i * 7) % 13 for i in range(21)], 8)


@pytest.fixture(scope="module")
def dense32(tmp_path_factory: pytest.TempPathFactory, kernels: object) -> dict[str, Path]:
    """Tiny random checkpoints built dense, for the fp32 engine (any CPU: ``f32gemm.h`` over the model's own
    weights)."""
    return _dense_engines(tmp_path_factory.mktemp("fused-dense32"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_dense_fp32_matches_the_eager_model(dense32: dict[str, Path], kind: str) -> None:
    """Dense fp32 weights: no rounding on either path (the fused step sums in another order), so one layer's
    logits agree to 1e-4 of their spread and the whole model's distributions to a KL of 1e-9, over 1 to 8
    rows a step (the GEMM's row passes and their remainders); K / V in the pages as close."""
    p = _pair(dense32[kind], layers=1)
    for eager, fused in _teacher_forced(p, [1, 3, 4, 9, 17, 2, 6, 5], 6, 256):
        assert float((eager - fused).abs().max()) < 1e-4 * float(eager.std())
    for a, b in zip(p.eager.kv.pools[:1], p.fused.kv.pools[:1], strict=True):
        assert float((a - b).abs().max()) < 1e-5 * float(a.abs().max())
    assert p.fused.fused is not None and p.fused.fused.steps == 6
    p = _pair(dense32[kind])
    for lengths in ([4], [2, 9, 1], [1 + (i * 7) % 13 for i in range(7)]):
        for eager, fused in _teacher_forced(p, lengths, 3, 256):
            assert float(_kl(eager, fused).max()) < 1e-9
            assert torch.equal(eager.argmax(-1), fused.argmax(-1))


def test_dense_fp32_steps_past_the_row_limit_run_eager(dense32: dict[str, Path]) -> None:
    """More rows than ``DENSE_F32_ROWS``: the step runs on the eager model (oneDNN's GEMMs win there)."""
    p = _pair(dense32["llama"])
    f = p.fused.fused
    assert f is not None and f.max_rows == DENSE_F32_ROWS
    _teacher_forced(p, [3] * DENSE_F32_ROWS, 2, 256)
    assert f.steps == 2
    _teacher_forced(p, [3] * (DENSE_F32_ROWS + 1), 2, 256)
    assert f.steps == 2

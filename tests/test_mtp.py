"""Multi-token prediction (DeepSeek-V3's MTP module) as a drafter: imported from checkpoints that
carry it, its drafts equal an independent reference built from Hugging Face's own decoder layers,
and speculation with it is lossless (greedy tokens equal plain decoding) on GQA and MLA + MoE."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from builders.errors import BuildError
from tests.helpers import build_tiny, mtp_reference, prompt_of, speculating_engine
from torch_engine.config import EngineManifest, KVLayout, SpecMethod, SpeculativeConfig
from torch_engine.engine import LLMEngine
from torch_engine.request import Request, RequestKind
from torch_engine.sampling import SamplingParams
from torch_engine.scheduler import SchedulerOutput
from torch_engine.speculator import Speculator

MTP = SpeculativeConfig(method=SpecMethod.MTP, num_tokens=1)
PROMPTS = [prompt_of(30, 1), prompt_of(9, 2), prompt_of(41, 3), prompt_of(2, 4)]


def engine(engine_dir: Path, spec: SpeculativeConfig | None = MTP, **kw: Any) -> LLMEngine:
    return speculating_engine(engine_dir, spec, **kw)


class _Oracle(Speculator):
    """Drafts the true next token (the speculator is the engine's injected room)."""

    def __init__(self, future: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(MTP, max_model_len=512)
        self.future = future

    def propose(self, req: Request, room: int, running: int) -> list[int]:
        return [self.future[tuple(req.prompt_ids)][req.num_tokens]]


class DraftLog:
    """Step observer (the engine's public port): every draft a step verifies, by request and position."""

    def __init__(self) -> None:
        self.drafts: list[tuple[str, int, tuple[int, ...]]] = []

    def before_step(self, sched: SchedulerOutput) -> None:
        self.drafts += [(c.request.request_id, c.start, c.draft) for c in sched.chunks if c.draft]

    def after_forward(self, sched: SchedulerOutput) -> None:
        pass


def run_logged(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[str], dict]:
    """Generate, recording after every step each request's MTP draft (for which position)."""
    ids = [eng.add_request(p, params) for p in prompts]
    made: dict[str, dict[int, int]] = {i: {} for i in ids}
    while eng.has_unfinished():
        eng.step()
        for i in ids:
            r = eng.request(i)
            if r.mtp_draft is not None:
                made[i][r.mtp_draft_at] = r.mtp_draft
    return ids, made


# -- import -----------------------------------------------------------------------------------


def test_mtp_layer_is_imported_and_its_absence_is_not_an_error(mtp_engine_dir, tiny_engine_dir) -> None:
    assert EngineManifest.load(mtp_engine_dir("deepseek_v3")).model.num_mtp_layers == 1
    # the plain tiny DeepSeek-V3 declares num_nextn_predict_layers = 1 (the HF default) but, saved by
    # Hugging Face, carries no MTP tensors: it builds without MTP, and asking it for MTP drafts is refused
    plain = tiny_engine_dir("deepseek_v3")
    assert EngineManifest.load(plain).model.num_mtp_layers == 0
    with pytest.raises(ValueError, match="mtp needs a checkpoint with an MTP module"):
        engine(plain)
    eng = engine(mtp_engine_dir("llama"), spec=None)  # an MTP engine need not speculate
    assert eng.kv_export().spec.num_layers == 3 and eng.generate([PROMPTS[0]], SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("eh_proj.weight", "MTP layer 2 is incomplete"),
        ("self_attn.o_proj.weight", "lacks tensor 'model.layers.2.self_attn.o_proj.weight'"),
        ("shared_head.head.weight", "differs from lm_head.weight"),
    ],
)
def test_broken_mtp_checkpoints_get_a_clear_error(mtp_tiny, tmp_path, drop: str, message: str) -> None:
    folder, _ = mtp_tiny("llama")
    broken = tmp_path / "ck"
    broken.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(folder / "model.safetensors"))
    name = f"model.layers.2.{drop}"
    if drop.startswith("shared_head"):
        state[name] = state[name] + 1.0  # not the model's head any more
    else:
        del state[name]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(BuildError, match=message):
        build_tiny(broken, tmp_path / "e")


# -- drafting and verification ------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "layout"), [("llama", KVLayout.HND), ("llama", KVLayout.NHD), ("deepseek_v3", None)])
def test_greedy_with_mtp_equals_without_and_drafts_equal_the_reference(
    kind: str, layout: KVLayout | None, mtp_engine_dir, mtp_tiny, engine_path
) -> None:
    """A batch with chunked prefill (chunks of 16) and a 2-token prompt: greedy tokens equal plain
    decoding; every draft the MTP pass made (after every step, for every request) equals the one
    Hugging Face's layers compute from the final sequence; the drafts verified were those."""
    if kind == "deepseek_v3" and engine_path == "graphs":
        pytest.skip("decode graphs serve models without MoE only")
    kw: dict[str, Any] = {"kv_layout": layout} if layout is not None else {}
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine(mtp_engine_dir(kind), spec=None, **kw).generate(PROMPTS, params)
    eng = engine(mtp_engine_dir(kind), **kw)
    log = DraftLog()
    eng.attach(log)
    ids, made = run_logged(eng, PROMPTS, params)
    assert [eng.request(i).output_ids for i in ids] == plain
    _, hf = mtp_tiny(kind)
    for i, rid in enumerate(ids):
        ref = mtp_reference(hf, PROMPTS[i] + plain[i])  # ref[p]: the draft for position p + 2
        assert made[rid] and all(ref[at - 2] == d for at, d in made[rid].items() if at < len(ref) + 2), rid
    assert log.drafts and all(d == (made[rid][s + 1],) for rid, s, d in log.drafts)
    assert eng.spec_stats.proposed == len(log.drafts)
    assert eng.page_stats().used == 0


def test_accepted_drafts_keep_the_mtp_layer_in_step(mtp_engine_dir, mtp_tiny) -> None:
    """Random weights seldom draft right; here every draft is right (an oracle stands in for the
    drafter: the true next token), so every step accepts its draft and emits two tokens, and the MTP
    pass then runs over both positions. Its drafts still equal the reference at every position."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = PROMPTS[:3]
    plain = engine(mtp_engine_dir("llama"), spec=None).generate(prompts, params)
    future = {tuple(p): p + o for p, o in zip(prompts, plain, strict=True)}
    eng = engine(mtp_engine_dir("llama"), speculator=_Oracle(future))
    ids, made = run_logged(eng, prompts, params)
    assert [eng.request(i).output_ids for i in ids] == plain
    assert eng.spec_stats.accepted == eng.spec_stats.proposed > 20
    _, hf = mtp_tiny("llama")
    for i, rid in enumerate(ids):
        ref = mtp_reference(hf, prompts[i] + plain[i])
        assert len(made[rid]) > 5 and all(ref[at - 2] == d for at, d in made[rid].items() if at < len(ref) + 2)


def test_sampled_requests_speculate_with_mtp(mtp_engine_dir) -> None:
    """Seeded sampled requests verify MTP drafts by rejection sampling (a point-mass draft, as for
    n-gram: the rule and its distribution are tested in test_speculative.py); they run to length
    and give every page back."""
    eng = engine(mtp_engine_dir("deepseek_v3"))
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=3)
    out = eng.generate(PROMPTS, params)
    assert all(len(o) == 20 for o in out)
    assert eng.spec_stats.proposed > 0 and eng.page_stats().used == 0


def test_mtp_layer_progress_counts_every_forward(mtp_engine_dir) -> None:
    """The MTP layer's KV is layer ``num_layers`` of the pools and of the layer counter: every
    forward pass bumps it once (after the decoder's layers), whether it had MTP work or not, so
    that a prefill node streams it like any other layer. An engine that does not draft computes
    MTP KV only for prefill-only requests (a decoder may draft from it)."""
    eng = engine(mtp_engine_dir("llama"), spec=None)
    eng.generate(PROMPTS, SamplingParams(max_tokens=5))
    counts = eng.kv_export().progress.snapshot()
    assert len(counts) == 3 and len(set(counts)) == 1 and counts[0] > 0
    assert not eng.kv_export().pools[2].any()  # nobody drafts here: no MTP KV computed
    rid = eng.add_request(PROMPTS[0], kind=RequestKind.PREFILL_ONLY)
    while eng.has_unfinished():
        eng.step()
    pages = eng.prefill_result(rid).pages
    assert all(bool(eng.kv_export().pools[2][p].any()) for p in pages)
    assert len(set(eng.kv_export().progress.snapshot())) == 1


# -- a trained head for a checkpoint without one ------------------------------------------------


def test_trained_head_attaches_and_drafts_losslessly(tiny, mtp_tiny, tiny_engine_dir, tmp_path) -> None:
    """``disagg train-mtp`` on the tiny Llama (its own greedy continuations): the head it writes
    attaches at build time (``BuildOptions.mtp_head``), the engine drafts with it, and greedy
    tokens equal plain decoding; a head for another model, or for a checkpoint that has one, is
    refused with the reason."""
    from builders import BuildOptions, build_engine
    from builders.train_mtp import train
    from torch_engine.config import DType

    folder, _ = tiny("llama")
    head = tmp_path / "head.safetensors"
    prompts = [prompt_of(12, 100 + i) for i in range(24)]
    report = train(str(folder), head, prompts=prompts, max_tokens=24, epochs=2, cache=tmp_path / "c", log=False)
    assert report.sequences == 24 and report.steps == 2 * (24 - 2)
    assert head.with_suffix(".json").is_file()
    opts = BuildOptions(dtype=DType.FLOAT32, page_size=4, mtp_head=head)
    eng_dir = build_engine(str(folder), tmp_path / "e", opts, progress=False)
    assert EngineManifest.load(eng_dir).model.num_mtp_layers == 1
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    eng = engine(eng_dir)
    assert eng.generate(PROMPTS, params) == engine(tiny_engine_dir("llama"), spec=None).generate(PROMPTS, params)
    assert eng.spec_stats.proposed > 0
    with pytest.raises(BuildError, match="already has an MTP layer"):
        build_engine(str(mtp_tiny("llama")[0]), tmp_path / "e2", opts, progress=False)
    with pytest.raises(BuildError, match=r"is not for this model \(layer 3\)"):
        build_engine(str(tiny("deepseek_v3")[0]), tmp_path / "e3", opts, progress=False)


def test_a_request_gives_up_drafting_that_does_not_pay(mtp_engine_dir) -> None:
    """``give_up_after = 1``: a request stops speculating at its first wholly rejected draft (its
    MTP work stops with it), so each request has at most one rejected draft; tokens are unchanged."""
    spec = SpeculativeConfig(method=SpecMethod.MTP, num_tokens=1, give_up_after=1)
    eng = engine(mtp_engine_dir("llama"), spec=spec)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ids, _ = run_logged(eng, PROMPTS, params)
    stats = [eng.request(i).spec for i in ids]
    assert all(s.proposed - s.accepted <= 1 for s in stats), stats
    assert any(s.misses == 1 for s in stats)  # some did give up (random weights draft badly)
    assert [eng.request(i).output_ids for i in ids] == engine(mtp_engine_dir("llama"), spec=None).generate(
        PROMPTS, params
    )

"""Decode steps through the decode-graph buckets: same tokens, padding touches no page, the layer
counter moves exactly once per step (on a GPU: from captured CUDA graphs, replayed)."""

from __future__ import annotations

import random

from tests import helpers
from tests.helpers import engine_config
from torch_engine.decode_graphs import bucket
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams
from torch_engine.scheduler import SchedulerOutput


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def test_bucket_sizes() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


class Steps:
    def __init__(self) -> None:
        self.n = 0

    def before_step(self, sched: SchedulerOutput) -> None:
        self.n += 1

    def after_forward(self, sched: SchedulerOutput) -> None:
        pass


def test_decode_graphs_equal_eager_and_count_layers(tiny_engine_dir) -> None:
    prompts = [prompt_of(3 + 11 * i, 40 + i) for i in range(5)]  # 3..47 tokens: several page-table widths
    params = [SamplingParams(max_tokens=5 + 3 * i) for i in range(5)]

    def run(graphs: bool) -> tuple[list[list[int]], LLMEngine, Steps]:
        engine = LLMEngine(
            engine_config(tiny_engine_dir("llama"), num_pages=64, decode_graphs=graphs), load_tokenizer=False
        )
        steps = Steps()
        engine.attach(steps)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        return [list(engine.request(i).output_ids) for i in ids], engine, steps

    want, _, _ = run(False)
    got, engine, steps = run(True)
    assert got == want
    graphs = engine.decode_graphs_stats()
    assert graphs is not None and graphs.replays > 0  # batches of 5, 4, ... shrinking as requests end
    if helpers.PATH.device == "cuda":
        assert graphs.captured > 0
    assert engine.kv_export().progress.snapshot() == [steps.n] * engine.describe().model.num_layers  # one bump per step
    assert engine.page_stats().used == 0


def test_moe_models_and_tp_groups_stay_eager(tiny_engine_dir) -> None:
    engine = LLMEngine(engine_config(tiny_engine_dir("deepseek_v3"), decode_graphs=True), load_tokenizer=False)
    assert engine.decode_graphs_stats() is None
    assert engine.generate([prompt_of(9, 1)], SamplingParams(max_tokens=3))[0]

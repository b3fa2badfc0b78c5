"""The per-layer completion counter moves during the forward pass and is readable from another thread."""

from __future__ import annotations

import itertools
import threading

from tests.helpers import tiny_engine
from torch_engine.sampling import SamplingParams
from torch_engine.scheduler import SchedulerOutput


def test_counter_bumps_once_per_layer_per_step(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("deepseek_v3"), chunk=5, budget=5)
    seen: list[tuple[int, list[int]]] = []

    class Observer:
        def before_step(self, sched: SchedulerOutput) -> None:
            seen.append((sched.step, engine.kv_export().progress.snapshot()))

        def after_forward(self, sched: SchedulerOutput) -> None:
            assert engine.kv_export().progress.snapshot() == [sched.step] * len(
                seen[-1][1]
            )  # every layer of this step ran

    engine.attach(Observer())
    engine.generate([list(range(1, 13))], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = len(seen)
    assert steps == 3 + 2  # 12 prompt tokens in chunks of 5, then 2 more decode steps
    assert engine.kv_export().progress.snapshot() == [steps] * 3
    for i, (_, counts) in enumerate(seen):  # observers run before the step's forward pass
        assert counts == [i] * 3


def test_poller_thread_sees_layers_finish_in_order(tiny_engine_dir) -> None:
    engine = tiny_engine(tiny_engine_dir("llama"))
    observed: list[list[int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            snap = engine.kv_export().progress.snapshot()
            if not observed or snap != observed[-1]:
                observed.append(snap)

    t = threading.Thread(target=poll)
    t.start()
    engine.generate([list(range(1, 200))], SamplingParams(max_tokens=20, ignore_eos=True))
    stop.set()
    t.join()
    for snap in observed:  # layer i never runs ahead of layer i-1
        assert all(a >= b for a, b in itertools.pairwise(snap))
    assert engine.kv_export().progress.snapshot() == [20, 20]  # 1 prefill + 19 decode steps
    assert len(observed) > 1

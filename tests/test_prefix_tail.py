"""A shared prompt's partial last page, copied from a running request instead of recomputed (copy on
write, ``PrefixCache.tail``): ``n`` > 1's other choices compute only their last prompt token. Tokens equal
the cache-off engine's; the copy holds the bytes a fresh computation writes; the holder keeps writing its
own page; nothing is left held."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import generate_staggered, prompt_of, tiny_engine
from torch_engine.config import KVLayout
from torch_engine.connector import Accepted, Placement
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

Dirs = Callable[..., Path]
PROMPT = prompt_of(103, 11)  # 102 tokens of KV before the last: 25 full 4-token pages + 2 tokens


def computed_tokens(engine: LLMEngine) -> int:
    s = engine.cache_stats()
    return s.queries - s.hits


@pytest.mark.parametrize(("kind", "layout"), [("llama", KVLayout.HND), ("llama", KVLayout.NHD), ("deepseek_v3", None)])
def test_other_choices_copy_the_partial_page_and_compute_one_token(
    kind: str, layout: KVLayout | None, engine_path: str, tiny_engine_dir: Dirs
) -> None:
    """``n`` = 4 on one engine: the first choice computes the prompt, each other one (added after its first
    token) shares the 25 full pages, copies the 2 tokens of the partial page and computes 1 token; greedy
    and seeded sampled choices give the cache-off engine's tokens (GQA in both layouts, MLA; every compute
    path: the copy is made before the step, whichever path runs it)."""
    on = tiny_engine(tiny_engine_dir(kind), layout=layout)
    off = tiny_engine(tiny_engine_dir(kind), layout=layout, prefix_cache=False)
    for params in ([SamplingParams(max_tokens=12)] * 4, [SamplingParams(max_tokens=12, temperature=1.0, seed=s)
                                                         for s in range(4)]):  # fmt: skip
        before = computed_tokens(on)
        outs = generate_staggered(on, [PROMPT] * 4, params)
        assert [o.cached_tokens for o in outs[1:]] == [102] * 3
        assert computed_tokens(on) - before == 103 + 3  # the prompt once, then one token per other choice
        want = generate_staggered(off, [PROMPT] * 4, params)
        assert [o.output_ids for o in outs] == [o.output_ids for o in want]
        on.clear_prefix_cache()
    s = on.page_stats()
    assert (s.used, s.pinned) == (0, 0)


def test_a_prompt_shorter_than_a_page_is_copied_too(tiny_engine_dir: Dirs) -> None:
    """No full page at all (4 tokens, pages of 4): the other choices copy the first 3 tokens' KV."""
    short = prompt_of(4, 5)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in range(3)]
    outs = generate_staggered(tiny_engine(tiny_engine_dir("llama")), [short] * 3, params)
    want = generate_staggered(tiny_engine(tiny_engine_dir("llama"), prefix_cache=False), [short] * 3, params)
    assert [o.cached_tokens for o in outs] == [0, 3, 3]
    assert [o.output_ids for o in outs] == [o.output_ids for o in want]


def test_the_copy_holds_the_holders_bytes_and_the_holder_keeps_its_page(tiny_engine_dir: Dirs) -> None:
    """Byte-level: the other choice gets a page of its own (not the holder's, which the holder goes on
    writing) holding, in the shared slots, the bytes the holder computed."""
    on = tiny_engine(tiny_engine_dir("llama"), layout=KVLayout.HND)  # a page: [kv heads, K / V, slot, dim]
    a = on.add_request(PROMPT, SamplingParams(max_tokens=20))
    while not on.request(a).output_ids:
        on.step()
    on.step()  # the holder writes its page past the shared slots (slot 3: its first output token)
    b = on.add_request(PROMPT, SamplingParams(max_tokens=20))
    on.step()  # b admitted, its copy made before the pass, its last prompt token computed
    ra, rb = on.request(a), on.request(b)
    assert rb.cached_tokens == 102 and rb.num_computed == 103
    assert rb.pages[:25] == ra.pages[:25] and rb.pages[25] != ra.pages[25]
    for pool in on.kv_export().pools:
        mine, theirs = pool[rb.pages[25]], pool[ra.pages[25]]
        torch.testing.assert_close(mine[:, :, :2], theirs[:, :, :2], atol=0, rtol=0)
    while on.has_unfinished():
        on.step()
    off = tiny_engine(tiny_engine_dir("llama"), prefix_cache=False)
    want = off.generate([PROMPT], SamplingParams(max_tokens=20))[0]
    assert on.retire(a).output_ids == want and on.retire(b).output_ids == want  # type: ignore[union-attr]


def test_no_copy_without_a_live_holder_nor_across_salts(tiny_engine_dir: Dirs) -> None:
    """A finished request's partial page is gone (not cached): the next one computes the 2 tokens; a
    request with another ``cache_salt`` never gets a copy; a prompt that differs inside the partial page
    computes it; the tokens are the cache-off engine's every time."""
    on = tiny_engine(tiny_engine_dir("llama"))
    off = tiny_engine(tiny_engine_dir("llama"), prefix_cache=False)
    first = generate_staggered(on, [PROMPT], [SamplingParams(max_tokens=6)])[0]
    later = generate_staggered(on, [PROMPT], [SamplingParams(max_tokens=6)])[0]
    assert (first.cached_tokens, later.cached_tokens) == (0, 100)
    other = [*PROMPT[:101], PROMPT[101] ^ 1, PROMPT[102]]
    salted = SamplingParams(max_tokens=6, cache_salt="tenant-b")
    outs = generate_staggered(on, [PROMPT, other, PROMPT], [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6),
                                                            salted])  # fmt: skip
    assert [o.cached_tokens for o in outs] == [100, 100, 0]
    want = off.generate([PROMPT, other], SamplingParams(max_tokens=6))
    assert [o.output_ids for o in outs] == [want[0], want[1], want[0]] and first.output_ids == want[0]


def test_preempted_holders_and_copies_keep_their_tokens(tiny_engine_dir: Dirs) -> None:
    """A pool too small for every choice: holders and copies are preempted and recomputed (from the cache,
    or from a copy again); every choice ends with the cache-off engine's tokens and no page stays held."""
    on = tiny_engine(tiny_engine_dir("llama"), num_pages=60, chunk=8, budget=24)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(5)]
    outs = generate_staggered(on, [PROMPT] * 5, params)
    off = tiny_engine(tiny_engine_dir("llama"), prefix_cache=False)
    want = generate_staggered(off, [PROMPT] * 5, params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in want]
    assert on.num_preemptions > 0
    s = on.page_stats()
    assert (s.used, s.pinned) == (0, 0)


def test_a_decoder_with_a_running_holder_keeps_the_other_choice_local(tiny_engine_dir: Dirs) -> None:
    """Disaggregated admission: with the prompt's partial page in a running request, an identical prompt
    has one uncached token (its last), so it is prefilled on the decoder and reaches no prefill node."""
    on = tiny_engine(tiny_engine_dir("llama"))
    a = on.add_request(PROMPT, SamplingParams(max_tokens=10))
    while not on.request(a).output_ids:
        on.step()
    asked: list[int] = []

    def place(_load: object, uncached: int) -> Placement:
        asked.append(uncached)
        return Placement.REMOTE

    adm = on.admit_for_kv(PROMPT, SamplingParams(max_tokens=10), "b", place)
    assert isinstance(adm, Accepted) and adm.placement is Placement.LOCAL and asked == []
    while on.has_unfinished():
        on.step()
    b = on.retire("b")
    assert b is not None and b.cached_tokens == 102 and b.output_ids == on.retire(a).output_ids  # type: ignore[union-attr]

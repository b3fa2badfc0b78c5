"""A request's way in: what a caller sends (text or token ids, sampling parameters, an id) becomes a
validated ``Request``, or an ``InvalidRequestError`` that names the problem. Nothing is queued here."""

from __future__ import annotations

import itertools
import random
from collections.abc import Container, Sequence

from torch_engine.guided import GrammarTable, Guide, GuideError
from torch_engine.request import Request, RequestKind
from torch_engine.sampling import InvalidRequestError, SamplerState, SamplingParams
from torch_engine.tokenizer import Tokenizer


class Intake:
    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int, page_size: int, num_pages: int
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._max_model_len = max_model_len
        self._page_size = page_size
        self._num_pages = num_pages
        self._ids = itertools.count()
        self._seed_rng = random.Random(0)  # seeds of requests that bring none
        self._grammars = GrammarTable(tokenizer.hf, vocab_size) if tokenizer is not None else None

    def check(self, ids: Sequence[int]) -> None:
        """Raise ``InvalidRequestError`` naming the problem if this engine cannot take the prompt."""
        if not ids:
            raise InvalidRequestError("prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {self._vocab})")
        if len(ids) >= self._max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context holds {self._max_model_len} (prompt + output)"
            )
        need = -(-(len(ids) + 1) // self._page_size)
        if need > self._num_pages:
            raise InvalidRequestError(f"prompt needs {need} KV pages; the pool has {self._num_pages}")

    def prepare_guide(self, guide: Guide) -> None:
        """Compile ``guide`` for this tokenizer now (any thread); ``InvalidRequestError`` naming the problem."""
        if self._grammars is None:
            raise InvalidRequestError("structured output needs a tokenizer; this engine has none", "guide")
        try:
            self._grammars.prepare(guide)
        except GuideError as exc:
            raise InvalidRequestError(str(exc), "guide") from None

    def new(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        kind: RequestKind,
        chat: bool,
        taken: Container[str],
    ) -> Request:
        """A validated request (``taken``: the ids in use)."""
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids")
            ids = self._tokenizer.encode(prompt, chat=chat)
        else:
            ids = [int(t) for t in prompt]
        self.check(ids)
        bad = next((t for t, _ in params.logit_bias if t >= self._vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias token id {bad} is outside the vocabulary [0, {self._vocab})", "logit_bias"
            )
        if params.stop and self._tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in taken:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        grammar = None
        if params.guide is not None and kind is not RequestKind.PREFILL_ONLY:  # a prefill-only request never samples
            self.prepare_guide(params.guide)
            assert self._grammars is not None
            grammar = self._grammars.matcher(params.guide)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Request(
            request_id=rid, prompt_ids=ids, params=params, kind=kind, sampler=SamplerState.seeded(seed), grammar=grammar
        )

"""Constrained decoding: a request's guide (a JSON schema, any JSON object, a regex, an EBNF or Lark
grammar) becomes a grammar matcher that lives with the request on the node that samples it (the
decoder; a prefill node never samples, so it never builds one).

The grammar engine is llguidance (PyPI, no dependencies). Measured against xgrammar 0.2.9 on the
embedded SmolLM2 tokenizer (49,152 tokens; a 3-field JSON schema, 32 tokens, AMD EPYC AVX2): masks
0.19 ms mean / 4.0 ms worst vs 0.017 / 0.16 ms, compile 3 vs 12 ms, token table 0.87 vs 0.38 s.
Both cost well under 1 % of a 110 ms decode step there; xgrammar's wheel requires OpenAI Triton on
Linux x86-64 (a 286 MB download, used only by its CUDA kernels), llguidance has no dependency, never
raises on a client's grammar (its matcher enters an error state instead) and bounds every mask
computation with its parser limits (``limits``), which is what a node facing clients needs.

The call order, per request (``Intake`` -> ``pick`` -> ``Outputs``):

1. ``GrammarTable.matcher(guide)``: a fresh matcher (a copy of the guide's compiled prototype,
   cached per guide), or ``GuideError`` naming the problem. ``check_guide`` validates without a
   tokenizer (the router, the Triton model's parse); ``GrammarTable.prepare`` compiles against the
   tokenizer from the caller's thread (``LLMEngine.prepare_guide``, called by ``DecodeLoop.submit``),
   so the loop only copies a prototype.
2. Each step that samples for it: ``GrammarState.masks(draft)`` — the allowed tokens at its next
   position and after each of its draft tokens (``Speculator.propose`` cut the draft to its
   longest valid prefix, ``valid_prefix``), computed by ``MaskPrefetch`` on a worker thread while
   the forward pass runs (llguidance releases the GIL); ``apply_masks`` sets every other logit to
   -inf.
3. Each token it emits: ``accept``; ``done`` once the grammar cannot go on (the request stops).
"""

from __future__ import annotations

import enum
import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from types import ModuleType

    from llguidance._lib import JsonCompileOptions

MAX_GUIDE_CHARS = 100_000  # a schema or grammar longer than this is refused
PROTOTYPES = 64  # compiled guides kept per engine (least recently used dropped)


def limits() -> llguidance.LLParserLimits:
    """llguidance's parser limits, bounding what one client's grammar may cost: its defaults for a
    step's lexer fuel, Earley items and the grammar's size; the initial lexer fuel a tenth of its
    default (measured here: the default let ``a{1000}{1000}`` take 2.0 s over its first mask, 100k
    takes 0.1 s, and a 70k-character schema of 1,200 fields still compiles)."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=100_000, step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=500_000
    )


# JSON as json.dumps writes it: no free whitespace (small models given free whitespace can emit newlines until
# max_tokens), ", " and ": " between items
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuideError(ValueError):
    """A guide that cannot be compiled; the message says why (at most ``MAX_ERROR_CHARS`` of it)."""

    def __init__(self, message: str) -> None:
        super().__init__(message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "...")


MAX_ERROR_CHARS = 600  # llguidance's errors can quote the parser's whole state


class GuideKind(enum.IntEnum):
    """What a guide's text is; ``wire`` is TensorRT-LLM's ``guided_decoding_guide_type`` value."""

    JSON = 0  # any JSON object (OpenAI's ``json_object``); the guide's text is ignored
    JSON_SCHEMA = 1
    REGEX = 2
    EBNF = 3  # GBNF, the EBNF of llama.cpp and xgrammar (TensorRT-LLM's ``ebnf_grammar``)
    LARK = 4  # llguidance's Lark dialect (vLLM's ``guidance`` backend takes it)

    @property
    def wire(self) -> str:
        return _WIRE[self]

    @classmethod
    def parse(cls, name: str) -> GuideKind:
        for kind, wire in _WIRE.items():
            if wire == name:
                return kind
        known = ", ".join(_WIRE.values())
        raise GuideError(f"guided_decoding_guide_type {name!r} is not supported (one of: {known})")


_WIRE = {
    GuideKind.JSON: "json",
    GuideKind.JSON_SCHEMA: "json_schema",
    GuideKind.REGEX: "regex",
    GuideKind.EBNF: "ebnf_grammar",
    GuideKind.LARK: "lark_grammar",
}


@dataclass(frozen=True, slots=True)
class Guide:
    kind: GuideKind
    text: str = ""


def check_guide(guide: Guide) -> None:
    """``GuideError`` naming the problem if the guide does not compile (cached per guide)."""
    _grammar(guide)


@functools.lru_cache(maxsize=256)
def _grammar(guide: Guide) -> str:
    """The guide as llguidance's grammar, validated (``GuideError`` otherwise)."""
    if not isinstance(guide.text, str) or len(guide.text) > MAX_GUIDE_CHARS:
        raise GuideError(f"the guide must be a string of at most {MAX_GUIDE_CHARS} characters")
    if guide.kind is not GuideKind.JSON and not guide.text.strip():
        raise GuideError(f"the {guide.kind.wire} guide is empty")
    try:
        grammar = _compile(guide)
    except (ValueError, TypeError, RecursionError) as exc:  # json's, the converter's, llguidance's own errors
        raise GuideError(f"invalid {guide.kind.wire} guide: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=limits())
    if error:
        raise GuideError(f"invalid {guide.kind.wire} guide: {error.strip()}")
    return grammar


def _compile(guide: Guide) -> str:
    M = llguidance.LLMatcher
    if guide.kind is GuideKind.JSON:
        return M.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if guide.kind is GuideKind.JSON_SCHEMA:
        schema = json.loads(guide.text)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema here is an object, not {type(schema).__name__}")
        return M.grammar_from_json_schema(guide.text, overrides=JSON_OPTIONS)
    if guide.kind is GuideKind.REGEX:
        return M.grammar_from_regex(guide.text)
    if guide.kind is GuideKind.EBNF:
        try:
            lark = gbnf_to_lark(guide.text)
        except Exception as exc:  # the converter raises plain Exceptions ("Rule 'foo' not found")
            raise ValueError(str(exc)) from None
        return M.grammar_from_lark(lark)
    return M.grammar_from_lark(guide.text)


class GrammarState:
    """One request's matcher (its parser state: every token it emitted so far)."""

    __slots__ = ("_m", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self._words = (vocab_size + 31) // 32

    def masks(self, draft: list[int]) -> torch.Tensor:
        """``[len(draft) + 1, words]`` int32 bitmasks: the tokens allowed next, then after each draft
        token (all valid: ``valid_prefix``). The state is unchanged afterwards. ``GuideError`` if the
        matcher is in an error state (a limit hit, an invalid token)."""
        rows = [self._mask()]
        for t in draft:
            if not self._m.consume_token(t):
                break
            rows.append(self._mask())
        consumed = len(rows) - 1
        if consumed and not self._m.rollback(consumed):
            raise GuideError(f"the grammar could not roll back {consumed} draft tokens: {self._m.get_error()}")
        if len(rows) < len(draft) + 1:  # positions after an invalid draft token: never chosen
            rows += [rows[-1]] * (len(draft) + 1 - len(rows))
        return torch.stack(rows)

    def _mask(self) -> torch.Tensor:
        raw = self._m.compute_bitmask()
        if self._m.is_error():
            if self.error.startswith("NoExtension"):  # the guide needs bytes after which no token of the model fits
                raise GuideError(f"the guide cannot be followed with this model's tokens: no token continues it "
                                 f"({self.error})")  # fmt: skip
            raise GuideError(f"grammar error: {self.error}")
        mask = torch.frombuffer(bytearray(raw), dtype=torch.int32)
        if mask.numel() < self._words:  # tokens past the tokenizer's vocabulary: never allowed
            mask = torch.cat([mask, torch.zeros(self._words - mask.numel(), dtype=torch.int32)])
        return mask[: self._words]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (the state is unchanged)."""
        return self._m.validate_tokens(tokens) if tokens else 0

    def accept(self, token: int) -> bool:
        """Advance by an emitted token; False if the grammar does not allow it (the request fails)."""
        return self._m.consume_token(token)

    @property
    def accepting(self) -> bool:
        """What was emitted so far is a whole answer the guide accepts (more may still be allowed)."""
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's error, its first line (the parser state it dumps after it is for debugging)."""
        return self._m.get_error().strip().split("\n", 1)[0]


class GrammarTable:
    """The engine's grammar side: the tokenizer's token table for llguidance (built on first use,
    ~0.9 s for SmolLM2's 49k tokens) and a prototype matcher per guide (least recently used of
    ``PROTOTYPES`` kept), copied for each request. Thread-safe."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self._hf = tokenizer
        self._vocab = vocab_size
        self._lock = threading.Lock()
        self._tok: llguidance.LLTokenizer | None = None
        self._prototypes: OrderedDict[Guide, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, guide: Guide) -> GrammarState:
        """A fresh matcher for ``guide`` (``GuideError`` naming the problem); ``prepare`` first, from
        the caller's thread, keeps the compile off the engine's loop."""
        return GrammarState(self._prototype(guide).deep_copy(), self._vocab)

    def prepare(self, guide: Guide) -> None:
        """Compile ``guide`` and its first mask now (cached; ``GuideError`` if it does not compile)."""
        self._prototype(guide)

    def _prototype(self, guide: Guide) -> llguidance.LLMatcher:
        grammar = _grammar(guide)
        with self._lock:
            proto = self._prototypes.get(guide)
            if proto is not None:
                self._prototypes.move_to_end(guide)
                return proto
        tokens = self._tokens()
        proto = llguidance.LLMatcher(tokens, grammar, log_level=0, limits=limits())  # unlocked: may take 100 ms
        proto.compute_bitmask()  # builds the lexer's first states (bounded by the initial fuel)
        if proto.is_error():
            raise GuideError(f"invalid {guide.kind.wire} guide: {proto.get_error().strip()}")
        with self._lock:
            self._prototypes[guide] = proto
            while len(self._prototypes) > PROTOTYPES:
                self._prototypes.popitem(last=False)
        return proto

    def _tokens(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab)  # type: ignore[arg-type]
            return self._tok


MaskWork = list[tuple[int, GrammarState, list[int]]]  # (key, the request's grammar, its draft)


class PendingMasks:
    """A step's masks, being computed: ``get(key)`` waits for one (``GuideError`` if its grammar failed)."""

    def __init__(self, futures: dict[int, Future[torch.Tensor]] | None = None) -> None:
        self._futures = futures or {}

    def get(self, key: int, state: GrammarState, draft: list[int]) -> torch.Tensor:
        """The masks for ``key`` (computed now, on this thread, if they were not prefetched)."""
        future = self._futures.get(key)
        return future.result() if future is not None else state.masks(draft)


NO_MASKS = PendingMasks()


class MaskPrefetch:
    """One worker thread (started on first use) that computes grammar masks beside the forward pass."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, work: MaskWork) -> PendingMasks:
        if not work:
            return NO_MASKS
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return PendingMasks({key: self._pool.submit(state.masks, draft) for key, state, draft in work})


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor, kernels: ModuleType | None = None) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` that ``masks[i]`` (int32 bitmask) disallows.
    ``kernels`` (the engine's CPU kernels): one pass over the words in C++ for fp32 CPU logits (the
    PyTorch ops below took ~0.3 ms a row for a 49k vocabulary: ~2.5 ms at batch 8, on the step's path)."""
    if not rows:
        return
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        kernels.mask_logits(logits, rows, masks.contiguous())
        return
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).bool().reshape(len(rows), -1)
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:  # logits padded past the mask's vocabulary
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[-1])], dim=-1)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    keep = allowed[:, :vocab].to(logits.device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))

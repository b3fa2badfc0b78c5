"""Tokenizer of an engine directory (HF ``tokenizer.json``) and an incremental detokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, engine_dir: Path) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(engine_dir), local_files_only=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            return self.encode_chat(messages)
        return list(self.hf.encode(text))

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation (``role`` / ``content`` turns, Hugging Face's ``tool_calls`` / ``tool`` turns) through
        the model's chat template, ready for the reply; ``tools`` are given to the template as they are."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template")
        given: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools is not None else None
        rendered = self.hf.apply_chat_template(messages, tools=given, tokenize=False, add_generation_prompt=True)
        assert isinstance(rendered, str)
        return list(self.hf.encode(rendered, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        text = self.hf.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eid = self.hf.eos_token_id
        return () if eid is None else (int(eid),)


class IncrementalDetokenizer:
    """Emits text as tokens arrive without ever splitting a UTF-8 character or a merge.

    Text is decoded over a short window of recent tokens; a trailing U+FFFD (an incomplete
    byte sequence) is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tail: list[int] | None = None) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_tail or [])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def window(self) -> tuple[list[int], int]:
        """The tokens the next ``push`` decodes over, and how many of them are already emitted."""
        return self.ids[self.prefix :], self.read - self.prefix

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        delta = window_text(self.tok, self.ids[self.prefix :], self.read - self.prefix)
        if delta:
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
        return delta


def whole_text(tok: Tokenizer, ids: list[int]) -> str:
    """All of ``ids``' text at once: a character the output stopped inside of is dropped, not the whole
    text (``window_text`` holds everything back while the text ends mid-character)."""
    return tok.decode(ids).rstrip("\ufffd")


def window_text(tok: Tokenizer, ids: list[int], skip: int) -> str:
    """New text of ``ids`` past its first ``skip`` tokens, or "" while it ends mid-character.

    The one rule both the engine loop and a separate postprocessing step apply, so that a
    window sent from one to the other decodes to exactly the same text.
    """
    prefix = tok.decode(ids[:skip])
    full = tok.decode(ids)
    if full.endswith("\ufffd") or len(full) <= len(prefix):
        return ""
    return full[len(prefix) :]

"""Tokenizer of an engine directory (HF ``tokenizer.json``) and an incremental detokenizer."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, engine_dir: Path) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(engine_dir), local_files_only=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            if not self.has_chat_template:
                raise ValueError("this model has no chat template")
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.hf.encode(text, add_special_tokens=False))
        return list(self.hf.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

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

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        full = self.tok.decode(self.ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

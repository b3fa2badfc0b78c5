"""Incremental detokenisation never splits a UTF-8 character and reproduces the full decode."""

from __future__ import annotations

from pathlib import Path

from torch_engine.tokenizer import IncrementalDetokenizer, Tokenizer


def test_incremental_equals_full_decode(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir)
    text = "Grüße aus Köln 🚀🙂 — naïve café, 日本語のテキスト. Done!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens held back mid-character

"""Incremental detokenisation never splits a UTF-8 character and reproduces the full decode."""

from __future__ import annotations

from pathlib import Path

from torch_engine.tokenizer import IncrementalDetokenizer, Tokenizer, whole_text, window_text


def test_incremental_equals_full_decode(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir)
    text = "Grüße aus Köln 🚀🙂 — naïve café, 日本語のテキスト. Done!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens held back mid-character


def test_a_whole_text_cut_inside_a_character_keeps_the_rest(smollm2_dir: Path) -> None:
    """An output that stops inside a character (max_tokens reached mid-emoji): answered at once, it keeps
    all its text but that character (``window_text`` held it all back); streamed, the token the character
    starts in is held back whole (here with the space before the emoji)."""
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode("Launch day 🚀")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids[:cut])
    assert window_text(tok, ids[:cut], 0) == ""  # what a non-streamed answer used to get
    assert whole_text(tok, ids[:cut]) == "Launch day " and streamed == "Launch day"

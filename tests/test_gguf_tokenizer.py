"""The embedded GGUF's tokenizer, built directly by the class ``AutoTokenizer`` picks for a byte-level BPE
(``builders/gguf_import.py``), saves the same files as ``AutoTokenizer`` itself does."""

from __future__ import annotations

import tempfile
from pathlib import Path

from builders.embedded import smollm2_gguf
from builders.gguf_import import save_gguf_tokenizer


def test_the_direct_tokenizer_saves_what_auto_tokenizer_saves(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    save_gguf_tokenizer(path, tmp_path / "direct", byte_level=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / path.name).symlink_to(path.resolve())
        AutoTokenizer.from_pretrained(tmp, gguf_file=path.name).save_pretrained(str(tmp_path / "auto"))
    names = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    for name in names:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "auto" / name).read_bytes(), name

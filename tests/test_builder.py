"""The checkpoint builder: shards, manifest, cache, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from builders import BuildError, BuildOptions, build_engine
from torch_engine.config import DType, EngineManifest, KVLayout, Role


def test_manifest_and_shards(tiny, tmp_path: Path) -> None:
    folder, _ = tiny("llama")
    opts = BuildOptions(role=Role.PREFILL, tp_size=2, dtype=DType.BFLOAT16, page_size=8, kv_layout=KVLayout.NHD)
    out = build_engine(str(folder), tmp_path / "e", opts, progress=False)
    m = EngineManifest.load(out)
    assert (m.role, m.tp_size, m.dtype, m.page_size, m.kv_layout) == (Role.PREFILL, 2, DType.BFLOAT16, 8, KVLayout.NHD)
    assert m.model.num_kv_heads == 4 and m.model.num_heads == 8
    for r in range(2):
        with safe_open(str(out / f"rank{r}.safetensors"), "pt") as f:
            qkv = f.get_tensor("layers.0.attn.qkv.weight")
            assert qkv.shape == ((4 + 2 * 2) * 8, 64)  # 4 of 8 q heads, 2 of 4 KV heads, head dim 8
            assert str(qkv.dtype) == "torch.bfloat16"
            assert f.get_tensor("layers.0.mlp.down.weight").shape == (64, 64)  # 128 / 2 columns


def test_build_is_cached(tiny, tmp_path: Path) -> None:
    folder, _ = tiny("qwen3")
    out = build_engine(str(folder), tmp_path / "e", progress=False)
    stamp = (out / "rank0.safetensors").stat().st_mtime_ns
    assert build_engine(str(folder), tmp_path / "e", progress=False) == out
    assert (out / "rank0.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    build_engine(str(folder), tmp_path / "e", BuildOptions(page_size=32), progress=False)  # options changed
    assert EngineManifest.load(out).page_size == 32


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="does not exist"):
        build_engine(str(tmp_path / "nothing"), tmp_path / "e")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(BuildError, match="not a valid GGUF file"):
        build_engine(str(bad), tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_corrupt_safetensors(tiny, tmp_path: Path) -> None:
    folder, _ = tiny("llama")
    bad = tmp_path / "ckpt"
    shutil.copytree(folder, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken header}")
    with pytest.raises(BuildError, match=r"model\.safetensors is corrupt"):
        build_engine(str(bad), tmp_path / "e")


def test_unsupported_architecture(tiny, tmp_path: Path) -> None:
    folder, _ = tiny("llama")
    bad = tmp_path / "ckpt"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BuildError, match="unsupported architecture 'gpt2'"):
        build_engine(str(bad), tmp_path / "e")


def test_missing_tensor(tiny, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = tiny("llama")
    bad = tmp_path / "ckpt"
    shutil.copytree(folder, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(BuildError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        build_engine(str(bad), tmp_path / "e")


def test_tp_that_does_not_divide(tiny, tmp_path: Path) -> None:
    folder, _ = tiny("llama")
    with pytest.raises(BuildError, match="TP 3 does not divide the 8 attention heads"):
        build_engine(str(folder), tmp_path / "e", BuildOptions(tp_size=3))


def test_embedded_gguf_config(smollm2_dir: Path) -> None:
    m = EngineManifest.load(smollm2_dir)
    cfg = m.model
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and m.has_tokenizer
    assert (smollm2_dir / "tokenizer.json").is_file()


def test_a_built_engine_is_readable_by_every_user(tiny, tmp_path: Path) -> None:
    """A shared engine cache (an image's, built as root and served as another user) must be readable."""
    folder, _ = tiny("llama")
    out = build_engine(str(folder), tmp_path / "e", progress=False)
    assert out.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.iterdir())


def test_a_copied_checkpoint_with_second_resolution_mtimes_reuses_the_cache(tiny, tmp_path: Path) -> None:
    """Archives (an image's layers) keep mtimes to the second: the fingerprint must not see the nanoseconds."""
    import os

    folder, _ = tiny("llama")
    out = build_engine(str(folder), tmp_path / "e", progress=False)
    stamp = (out / "rank0.safetensors").stat().st_mtime_ns
    for f in folder.iterdir():
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns // 10**9 * 10**9))  # what a tar round trip leaves
    build_engine(str(folder), tmp_path / "e", progress=False)
    assert (out / "rank0.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt

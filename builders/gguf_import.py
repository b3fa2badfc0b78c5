"""Import a llama-architecture GGUF file (e.g. the packaged SmolLM2 Q4_1): rename, un-permute, and either
keep the quantized tensors as stored (``packed``: Q8_0 / Q6_K / Q5_K / Q5_1 / Q5_0 / Q4_K / Q4_1 / Q4_0,
``torch_engine.quant``; other quantized formats converted, ``builders/gguf_convert.py``) or dequantise.

llama.cpp's converter permutes the rows of the Q and K projections so that rotary pairs are
interleaved; HF (and this engine) pair dimension i with i + head_dim/2, so the permutation
is undone here.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from builders.checkpoint import Checkpoint
from builders.errors import BuildError
from builders.gguf_convert import convert, converts
from builders.gguf_file import GGUFFile, GGUFTensor, read_gguf
from builders.quantize import QuantReport
from torch_engine.config import Family, ModelConfig
from torch_engine.gguf_blocks import from_gguf_blocks
from torch_engine.quant import BLOCK, Packed, QuantKind, Weight

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute(w: Weight, n_heads: int) -> Weight:
    rows = w.shape[0]
    order = torch.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(rows)
    return w.rows(order) if isinstance(w, Packed) else w[order]


def _tensor(path: Path, t: GGUFTensor, packed: bool, report: QuantReport) -> Weight:
    kinds = {int(k) for k in QuantKind}
    shape = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else None  # GGUF lists [K, N]
    try:
        if packed and shape is not None and int(t.tensor_type) in kinds:
            return from_gguf_blocks(QuantKind(int(t.tensor_type)), t.data, shape)
        if packed and shape is not None and shape[1] % BLOCK == 0 and converts(t.tensor_type):
            return convert(t.tensor_type, t.data, shape, report)
    except ValueError as exc:
        raise BuildError(f"{path}: {t.name}: {exc}") from exc
    except NotImplementedError as exc:
        raise BuildError(f"{path}: cannot dequantise {t.name} ({t.tensor_type.name}): {exc}") from exc
    try:
        arr = dequantize(t.data, t.tensor_type)
    except (ValueError, NotImplementedError) as exc:
        raise BuildError(f"{path}: cannot dequantise {t.name} ({t.tensor_type.name}): {exc}") from exc
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def save_gguf_tokenizer(path: Path, out: Path, byte_level: bool) -> None:
    """The tokenizer of the GGUF file ``path``, as transformers converts it, saved into ``out``. A byte-level BPE
    (``tokenizer.ggml.model`` gpt2: SmolLM2, Llama 3) is built by the class ``AutoTokenizer`` picks for it,
    directly: ``AutoTokenizer`` first reads the file's whole model config through gguf-py to learn that class
    (~10 s of the 20.6 s SmolLM2 build before, for the same files; ``tests/test_gguf_tokenizer.py`` checks they
    stay the same); a sentencepiece vocabulary goes through ``AutoTokenizer`` (its class depends on more than
    the file)."""
    from transformers import AutoTokenizer, TokenizersBackend  # the GGUF tokenizer converter lives in transformers

    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / path.name
        link.symlink_to(path.resolve())
        loader = TokenizersBackend if byte_level else AutoTokenizer
        tok = loader.from_pretrained(tmp, gguf_file=path.name)
    tok.save_pretrained(str(out))


def load_gguf(path: Path, packed: bool = True) -> Checkpoint:
    """The checkpoint in ``path``; ``packed``: 2-D tensors in a block format the engine computes with
    (``QuantKind``) stay as stored, those in another quantized format are converted into one
    (``builders/gguf_convert.py``: IQ4_XS, the other IQ formats; the error in ``Checkpoint.converted``);
    otherwise every tensor is dequantised to fp32."""
    try:
        reader = read_gguf(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise BuildError(f"{path} is not a valid GGUF file: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise BuildError(
            f"{path}: GGUF architecture {arch!r} is not supported (only 'llama'; use an HF folder for others)"
        )
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    kv_heads = int(_field(reader, p + "attention.head_count_kv", heads))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    vocab = int(_field(reader, p + "vocab_size", len(tokens)))
    tensors: dict[str, Weight] = {}
    report = QuantReport()
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{_LAYER_NAMES.get(rest, rest)}"
        else:
            name = _GLOBAL_NAMES.get(t.name, t.name)
        w = _tensor(path, t, packed, report)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[name] = w
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        family=Family.LLAMA,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, p + "context_length", 4096)),
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )

    byte_level = _field(reader, "tokenizer.ggml.model") == "gpt2"

    def save_tokenizer(out: Path) -> bool:
        save_gguf_tokenizer(path, out, byte_level)
        return True

    if report.tensors:
        log.info("%s: converted at build time: %s", path.name, report.summary())
    return Checkpoint(cfg, tensors, save_tokenizer, path.stem, report.errors())

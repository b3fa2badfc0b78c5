"""A GGUF file copied with some of its tensors stored in another format: the K-quant mixes the tests and
benchmarks need from the embedded file (gguf's Python package reads every format but writes few)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_reader import ReaderTensor

# a tensor -> its new raw blocks and type, or None (copied as it is)
Convert = Callable[[ReaderTensor], tuple[np.ndarray, GGMLQuantizationType] | None]


def rewrite(src: Path, dst: Path, convert: Convert) -> int:
    """``src`` copied to ``dst`` (every metadata field, every tensor), each tensor ``convert`` answers for
    written as it says; returns how many were rewritten."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), arch="llama")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype is GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    n = 0
    for t in reader.tensors:
        new = convert(t)
        if new is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        else:
            raw, qtype = new
            writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            n += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return n


def llama_quantize(src: Path, dst: Path, ftype: str) -> None:
    """``src`` requantized by llama.cpp's own quantizer (its binding: ``make bench-peers``) to ``ftype``, a
    ``LLAMA_FTYPE_MOSTLY_*`` name (``Q4_K_M``, ``Q5_K_M``): the mixes published files use."""
    import ctypes

    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.allow_requantize = True
    p.nthread = 2
    dst.parent.mkdir(parents=True, exist_ok=True)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")

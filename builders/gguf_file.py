"""A GGUF file's metadata and tensors, read in one pass over the header.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every metadata value: the embedded SmolLM2's
49,152 tokens and 48,900 merges cost it ~6 s a read here, most of a ~10 s build. This reads the header with
``struct`` (the values as Python values) and maps the tensor data once; each tensor's ``data`` is the array
``GGUFReader`` gives for it (same dtype, shape and bytes: quantized types as bytes ``[..., row bytes]``, float
and integer types as their values), so ``gguf.quants.dequantize`` and this project's block readers take it
unchanged (``tests/test_gguf_file.py`` compares the two readers on every file the tests build).

Format (GGUF v2 / v3, little-endian): magic ``GGUF``, version u32, tensor count u64, key-value count u64; each
key-value a string key, a u32 value type and the value (strings: u64 length + UTF-8; arrays: u32 item type, u64
count, items); each tensor a string name, u32 dimension count, u64 dimensions (fastest-varying first), u32 ggml
type, u64 offset into the data section, which starts at the next multiple of ``general.alignment`` (32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_VALUES = {  # the ggml types stored as values, not blocks, and their numpy dtype (gguf-py's choice)
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

Value = int | float | bool | str | list["Value"]


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first ([K, N] for a weight)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # read-only, mapped from the file


@dataclass(frozen=True, slots=True)
class GGUFFile:
    version: int
    fields: dict[str, Value]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> int | float | bool:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = int(self.scalar("<Q"))
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int) -> Value:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = int(self.scalar("<I")), int(self.scalar("<Q"))
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[item]
                out = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += count * struct.calcsize(fmt)
                return out
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.pos}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and its tensors (``ValueError`` where it is not a GGUF file this can read)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    c = _Cursor(memoryview(mapped.data))  # the mapping itself, no copy
    try:
        if bytes(c.buf[:4]) != _MAGIC:
            raise ValueError("no GGUF magic")
        c.pos = 4
        version = int(c.scalar("<I"))
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (this reads {_VERSIONS})")
        n_tensors, n_fields = int(c.scalar("<Q")), int(c.scalar("<Q"))
        fields: dict[str, Value] = {}
        for _ in range(n_fields):
            key = c.string()
            fields[key] = c.value(int(c.scalar("<I")))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(int(c.scalar("<Q")) for _ in range(int(c.scalar("<I"))))
            infos.append((name, dims, GGMLQuantizationType(int(c.scalar("<I"))), int(c.scalar("<Q"))))
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"truncated or corrupt header: {exc}") from exc
    align = int(fields.get("general.alignment", 32))  # type: ignore[arg-type]
    start = -(-c.pos // align) * align
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name} appears twice")
        names.add(name)
        n = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        dtype = _VALUES.get(kind)
        shape = tuple(reversed(dims))
        count = n if dtype is not None else n * size // block
        at = start + offset
        end = at + count * (np.dtype(dtype).itemsize if dtype is not None else 1)
        if end > mapped.size:
            raise ValueError(f"tensor {name} ends at byte {end}, past the file's {mapped.size}")
        raw = mapped[at:end]
        if dtype is not None:
            data = raw.view(dtype).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, dims, kind, data))
    return GGUFFile(version, fields, tensors)

"""``builders/gguf_file.py`` against gguf-py's ``GGUFReader``: the same metadata values and, for every tensor, the
same name, type, shape and data (dtype, shape, bytes); files it cannot read are a ``ValueError`` naming why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

from builders.embedded import smollm2_gguf
from builders.gguf_file import read_gguf


def _assert_same_as_gguf_py(path: Path, flattened: tuple[str, ...] = ()) -> None:
    """``flattened``: arrays of arrays, which gguf-py's ``contents()`` returns flattened (read as nested here)."""
    ours, theirs = read_gguf(path), GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # gguf-py's own header entries
    assert list(ours.fields) == keys
    for k in keys:
        want = theirs.fields[k].contents()
        got = ours.fields[k]
        if k in flattened:
            assert isinstance(got, list)
            got = [x for row in got for x in row]  # type: ignore[union-attr]
        assert got == want, k
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, b.shape.tolist())
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name


def test_the_embedded_file_reads_as_gguf_py_reads_it() -> None:
    _assert_same_as_gguf_py(smollm2_gguf())


def test_every_value_type_and_tensor_layout_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    """Scalars of each width, strings (non-ASCII too), arrays of numbers, of strings and of arrays, a custom
    alignment; tensors stored as values (F32, F16, I32) and as blocks (Q8_0, Q4_K), 1-D to 3-D."""
    path = tmp_path / "all.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", -2.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.0])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("v.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("v.f16", rng.standard_normal(7).astype(np.float16))
    w.add_tensor("v.i32", np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    w.add_tensor("b.Q8_0", quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("b.Q4_K", rng.integers(0, 256, (4, 144), dtype=np.uint8), raw_dtype=T.Q4_K)  # one block a row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same_as_gguf_py(path, flattened=("t.nested",))
    f = read_gguf(path)
    assert f.fields["t.str"] == "héllo ✓" and f.fields["t.nested"] == [[1, 2], [3]] and f.fields["t.bool"] is True
    assert [t.tensor_type for t in f.tensors][-2:] == [T.Q8_0, T.Q4_K] and f.tensors[-1].data.shape == (4, 144)


@pytest.mark.parametrize(
    ("mangle", "problem"),
    [
        (lambda b: b"GGML" + b[4:], "no GGUF magic"),
        (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "GGUF version 9"),
        (lambda b: b[:200], "truncated or corrupt header|past the file"),
    ],
)
def test_what_it_cannot_read_is_a_value_error_naming_why(tmp_path: Path, mangle, problem: str) -> None:
    src = tmp_path / "ok.gguf"
    w = GGUFWriter(str(src), "llama")
    w.add_array("t.strs", ["x" * 50] * 10)
    w.add_tensor("v.f32", np.ones((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mangle(src.read_bytes()))
    with pytest.raises(ValueError, match=problem):
        read_gguf(bad)

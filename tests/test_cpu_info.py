"""The CPU record every benchmark carries: /proc/cpuinfo's first entry, its CPUID family and model, the core."""

from __future__ import annotations

import pytest

from torch_engine.cpu import CpuInfo, core_name, cpu_info, parse_cpuinfo


def _entry(n: int, vendor: str, family: int, model: int, name: str, flags: str) -> str:
    return (
        f"processor\t: {n}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: {name}\nstepping\t: 0\nflags\t\t: {flags}\n\n"
    )


def test_the_first_entry_is_read() -> None:
    text = _entry(0, "AuthenticAMD", 25, 17, "AMD EPYC", "fpu avx2 fma avx512f avx512_bf16") + _entry(
        1, "GenuineIntel", 6, 143, "other", "fpu"
    )
    info = parse_cpuinfo(text, "x86_64")
    assert (info.vendor, info.family, info.model_id, info.model) == ("AuthenticAMD", 25, 17, "AMD EPYC")
    assert info.flags == frozenset({"fpu", "avx2", "fma", "avx512f", "avx512_bf16"})
    assert info.core == "Zen 4" and info.simd == "avx512_bf16"
    assert info.label == "AMD EPYC (family 25 model 17: Zen 4)"
    d = info.as_dict()
    assert (d["family"], d["model_id"], d["core"]) == (25, 17, "Zen 4")
    assert d["flags"] == ["avx2", "avx512_bf16", "avx512f", "fma"]


@pytest.mark.parametrize(
    ("vendor", "family", "model", "core"),
    [
        ("AuthenticAMD", 23, 1, "Zen 1"),  # QEMU's "EPYC": what session 33's AVX2-only host reported
        ("AuthenticAMD", 23, 49, "Zen 2"),
        ("AuthenticAMD", 25, 1, "Zen 3"),
        ("AuthenticAMD", 25, 17, "Zen 4"),
        ("AuthenticAMD", 26, 2, "Zen 5"),
        ("GenuineIntel", 6, 143, "Sapphire Rapids"),
        ("GenuineIntel", 6, 85, "Skylake / Cascade Lake / Cooper Lake"),
        ("GenuineIntel", 6, 151, None),  # a client core the table does not name
        ("AuthenticAMD", 21, 2, None),
        ("GenuineIntel", 25, 17, None),  # AMD's numbers under another vendor name nothing
    ],
)
def test_the_core_by_family_and_model(vendor: str, family: int, model: int, core: str | None) -> None:
    assert core_name(vendor, family, model) == core


def test_without_family_the_label_is_the_model_name() -> None:
    info = parse_cpuinfo("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: avx2\n", "x86_64")
    assert (info.family, info.model_id, info.core) == (None, None, None)
    assert info.label == "Some CPU"
    assert parse_cpuinfo("", "aarch64") == CpuInfo("aarch64", frozenset(), "", None, None)


def test_this_machine() -> None:
    info = cpu_info()
    assert info.model and info.label.startswith(info.model)
    assert set(info.as_dict()) == {"model", "family", "model_id", "core", "simd", "flags"}

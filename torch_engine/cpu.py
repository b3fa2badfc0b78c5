"""What the CPU this engine runs on can do, read once from ``/proc/cpuinfo``.

Machines of one kind differ (some have AVX-512 BF16 and AMX, some are AVX2-only); the engine picks
its dtype and kernel path from this, and the benchmarks record it with every result. A virtual
machine's model name may say no more than "AMD EPYC" for CPUs four generations apart (session 33's
host reported family 23 model 1, AVX2 only; session 37's family 25 model 17, AVX-512 BF16, under the
same name), so the CPUID family and model are recorded too, and the core they name where the table
below knows it (a hypervisor reports the CPU model it was told to, as the flags are the ones it lets through).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# (vendor, family, first model, last model) -> core, from the vendors' CPUID tables.
_CORES: tuple[tuple[str, int, int, int, str], ...] = (
    ("AuthenticAMD", 23, 0x00, 0x2F, "Zen 1"),
    ("AuthenticAMD", 23, 0x30, 0x7F, "Zen 2"),
    ("AuthenticAMD", 23, 0x90, 0xAF, "Zen 2"),
    ("AuthenticAMD", 25, 0x00, 0x0F, "Zen 3"),
    ("AuthenticAMD", 25, 0x10, 0x1F, "Zen 4"),
    ("AuthenticAMD", 25, 0x20, 0x5F, "Zen 3"),
    ("AuthenticAMD", 25, 0x60, 0xAF, "Zen 4"),
    ("AuthenticAMD", 26, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 0x55, 0x55, "Skylake / Cascade Lake / Cooper Lake"),
    ("GenuineIntel", 6, 0x6A, 0x6C, "Ice Lake"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0xCF, 0xCF, "Emerald Rapids"),
    ("GenuineIntel", 6, 0xAD, 0xAE, "Granite Rapids"),
)


def core_name(vendor: str, family: int | None, model_id: int | None) -> str | None:
    """The core a CPUID vendor, family and model name (``None`` where the table does not know it)."""
    if family is None or model_id is None:
        return None
    for v, f, lo, hi, name in _CORES:
        if v == vendor and f == family and lo <= model_id <= hi:
            return name
    return None


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    vendor: str = ""
    family: int | None = None  # CPUID's (extended) family and model, as /proc/cpuinfo gives them
    model_id: int | None = None

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX-512 BF16 or AMX-BF16): bf16 GEMMs run faster than fp32."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def simd(self) -> str:
        for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
            if name in self.flags:
                return name
        return "baseline"

    @property
    def core(self) -> str | None:
        return core_name(self.vendor, self.family, self.model_id)

    @property
    def label(self) -> str:
        """The model name with CPUID's family and model (and the core they name): "AMD EPYC (family 25 model 17:
        Zen 4)"."""
        if self.family is None or self.model_id is None:
            return self.model
        core = self.core
        return f"{self.model} (family {self.family} model {self.model_id}{': ' + core if core else ''})"

    def as_dict(self) -> dict[str, object]:
        wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
        return {
            "model": self.model, "family": self.family, "model_id": self.model_id, "core": self.core,
            "simd": self.simd, "flags": sorted(f for f in wanted if f in self.flags),
        }  # fmt: skip


def parse_cpuinfo(text: str, default_model: str) -> CpuInfo:
    """The first processor's entry of a ``/proc/cpuinfo`` text."""
    model, flags, vendor = default_model, frozenset[str](), ""
    family: int | None = None
    model_id: int | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if not key and flags:
            break  # the end of the first processor's entry
        if key == "model name" and value:
            model = value
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        elif key == "vendor_id" and not vendor:
            vendor = value
        elif key == "cpu family" and family is None and value.isdigit():
            family = int(value)
        elif key == "model" and model_id is None and value.isdigit():
            model_id = int(value)
    return CpuInfo(model, flags, vendor, family, model_id)


@functools.cache
def cpu_info() -> CpuInfo:
    default = platform.processor() or platform.machine()
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return CpuInfo(default, frozenset())
    return parse_cpuinfo(path.read_text(encoding="utf-8", errors="replace"), default)

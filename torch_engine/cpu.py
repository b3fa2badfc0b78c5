"""What the CPU this engine runs on can do, read once from ``/proc/cpuinfo``.

Machines of one kind differ (some have AVX-512 BF16 and AMX, some are AVX2-only); the engine picks
its dtype and kernel path from this, and the benchmarks record it with every result.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    flags: frozenset[str]

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

    def as_dict(self) -> dict[str, object]:
        wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
        return {"model": self.model, "simd": self.simd, "flags": sorted(f for f in wanted if f in self.flags)}


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    path = Path("/proc/cpuinfo")
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    return CpuInfo(model, flags)

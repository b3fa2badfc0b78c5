"""Hardware profiles and the cost curves read from them: what a step of an engine costs.

A ``HardwareProfile`` is a file (JSON, versioned) of measured or derived points:

- ``prefill``: seconds of one step that prefills one prompt of N tokens alone;
- ``decode``: seconds of one decode step of B sequences at a mean context of C tokens (a grid);
- the KV bytes of one token and the link that moves them (bytes/s plus a fixed latency).

``disagg bench engine --profile`` measures one on this machine (``bench/profile.py``); a named GPU
(``planner/gpus.py``) derives one from published figures through a roofline. ``CostModel`` reads
either the same way, so the simulator (``planner/simulator.py``) and a decode node's per-request
placement rule (``planner/placement.py``) use the same curves.
"""

from __future__ import annotations

import bisect
import enum
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILE_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProfileSource(enum.StrEnum):
    MEASURED = "measured"  # timed on a machine (``disagg bench engine --profile``)
    ROOFLINE = "roofline"  # derived from a device's published bandwidth and FLOP/s


class DecodeGrid(_Frozen):
    batches: list[int] = Field(min_length=1)
    contexts: list[int] = Field(min_length=1)
    seconds: list[list[float]]  # [batch index][context index]

    @model_validator(mode="after")
    def _shape(self) -> DecodeGrid:
        if sorted(set(self.batches)) != self.batches or sorted(set(self.contexts)) != self.contexts:
            raise ValueError("decode grid: batches and contexts must be strictly increasing")
        if len(self.seconds) != len(self.batches) or any(len(r) != len(self.contexts) for r in self.seconds):
            raise ValueError(
                f"decode grid: seconds must be {len(self.batches)} rows of {len(self.contexts)} (batches x contexts)"
            )
        return self


class HardwareProfile(_Frozen):
    version: int = PROFILE_VERSION
    name: str = Field(min_length=1, description="what ran: e.g. 'AMD EPYC, 1 thread, bf16' or 'H100 x 8'")
    source: ProfileSource
    model: str = Field(description="the model the curves are of")
    device: dict[str, str] = Field(default_factory=dict, description="CPU model and flags, threads, dtype, kernels")
    devices: int = Field(default=1, ge=1, description="devices one engine instance of this profile spans")
    prefill: list[tuple[int, float]] = Field(min_length=2, description="(prompt tokens, seconds of one step)")
    decode: DecodeGrid
    kv_bytes_per_token: int = Field(ge=0, description="KV of one token, all layers, as sent between roles")
    link_bytes_per_s: float = Field(gt=0, description="KV transfer rate between a prefill and a decode instance")
    link_latency_s: float = Field(default=0.0, ge=0, description="fixed cost of one KV transfer")
    max_batch_tokens: int | None = Field(
        default=None, ge=1, description="KV tokens one instance holds (memory left after the weights); None: no limit"
    )

    @model_validator(mode="after")
    def _check(self) -> HardwareProfile:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version}; this planner reads version {PROFILE_VERSION}")
        xs = [t for t, _ in self.prefill]
        if sorted(set(xs)) != xs:
            raise ValueError("prefill points must have strictly increasing token counts")
        return self

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON hardware profile ({exc})") from None
        return cls.model_validate(raw)

    def dump(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.model_dump_json(indent=2), encoding="utf-8")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through the points; linear beyond the ends (from the two end points)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class CostModel:
    """Step times from a profile. A mixed step (decodes and a prefill chunk together, as chunked
    prefill runs them) reads the weights once: it costs the decode step plus the prefill's time
    above a one-token step. ``step_overhead_s`` is what a serving process adds to every step beyond
    the engine's own (its loop, callbacks, detokenisation, streaming the tokens out); measured at
    idle by the serving benchmark."""

    def __init__(self, profile: HardwareProfile, step_overhead_s: float = 0.0) -> None:
        self.profile = profile
        self.step_overhead_s = step_overhead_s
        self._px = [float(t) for t, _ in profile.prefill]
        self._py = [s for _, s in profile.prefill]
        g = profile.decode
        self._bx = [float(b) for b in g.batches]
        self._cx = [float(c) for c in g.contexts]
        self._rows = g.seconds
        self._one = max(self.prefill_s(1), 0.0)

    def prefill_s(self, tokens: int) -> float:
        return max(_interp(self._px, self._py, float(tokens)), 1e-6) + self.step_overhead_s

    def decode_s(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        by_ctx = [_interp(self._cx, row, context) for row in self._rows]
        return max(_interp(self._bx, by_ctx, float(batch)), 1e-6) + self.step_overhead_s

    def step_s(self, decodes: int, context: float, prefill_tokens: int) -> float:
        if prefill_tokens <= 0:
            return self.decode_s(decodes, context)
        if decodes <= 0:
            return self.prefill_s(prefill_tokens)
        return self.decode_s(decodes, context) + max(self.prefill_s(prefill_tokens) - self._one, 0.0)

    def transfer_s(self, tokens: int) -> float:
        p = self.profile
        return p.link_latency_s + tokens * p.kv_bytes_per_token / p.link_bytes_per_s

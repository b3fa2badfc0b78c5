"""Conditional disaggregation: does a decode node prefill a request itself, or send it to a prefill group?

One rule, used by a decode node for every request (``serving/decode_path.py``) and by the planner's
simulator (``planner/simulator.py``), from the same cost curves (``CostModel``):

- **local**: the prompt (behind the prefill work already waiting on this engine) runs in chunks
  of ``chunk`` tokens mixed into the running decodes' steps; its first token comes out of the
  last chunk. Each running stream waits the steps' extra time (``stall_s``).
- **remote**: the prompt waits behind the prefill group's outstanding tokens, is prefilled
  there (all but its last token), its KV crosses the link, then the decode loop notices it at
  its next step boundary (half a step on average; at once when no step runs) and runs the last
  prompt token in a step of ``running + 1`` sequences. ``overhead_s`` is the fixed cost of the round trip (the call, the
  notification), measured per deployment.

Local wins when ``local_s + running * stall_s <= remote_s``: the prompt's own TTFT plus what it
costs every running stream must not exceed its TTFT the other way. An idle decode engine takes
short prompts itself; a busy one sends them away; a busy prefill pool keeps more at home.

That sum trades the streams' seconds against the prompt's and knows no SLO: a stall of one step
per stream is cheap in it, yet each such step is an inter-token interval the split exists to
remove. With an ITL budget (``itl_budget_s``, the deployment's ITL / TPOT SLO) a prompt is
prefilled here while streams are decoding (or prompts are queued here: they will be) only if its
longest chunk step stays within the budget
(on the Emerald Rapids Xeon, session 41, ``make bench``'s prefill-heavy run without it: the decode
node prefilled 14-35 of 50 prompts itself in ~270 ms steps, and its stalled intervals exceeded the
colocated replicas' at two of five rates). An idle engine still takes what the cost rule gives it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.profile import CostModel, HardwareProfile


class PrefillPlacement(enum.StrEnum):
    REMOTE = "remote"  # always a prefill group (prompts of one token excepted: nothing to prefill)
    LOCAL = "local"  # always this decode node (a disaggregated deployment serving as colocated)
    AUTO = "auto"  # per request, by the cost rule


@dataclass(frozen=True, slots=True)
class PlacementInputs:
    prompt_tokens: int
    running: int  # sequences decoding on this engine now
    context: float  # their mean context (tokens)
    local_queue_tokens: int  # prompt tokens already waiting to be prefilled on this engine
    remote_queue_tokens: int  # outstanding prefill tokens at the prefill group it would go to
    chunk: int  # this engine's prefill tokens per step


@dataclass(frozen=True, slots=True)
class Decision:
    local: bool
    local_s: float  # estimated TTFT if prefilled here
    remote_s: float  # estimated TTFT if sent to a prefill group
    stall_s: float  # extra wait each running stream gets if prefilled here


def _chunked_s(costs: CostModel, running: int, context: float, tokens: int, chunk: int) -> tuple[float, int]:
    """Seconds of the steps that prefill ``tokens`` in chunks beside ``running`` decodes, and how many steps."""
    full, rest = divmod(max(tokens, 1), chunk)
    seconds = full * costs.step_s(running, context, chunk) + (costs.step_s(running, context, rest) if rest else 0.0)
    return seconds, full + (1 if rest else 0)


def decide(
    x: PlacementInputs,
    local: CostModel,
    remote: CostModel,
    overhead_s: float,
    mode: PrefillPlacement,
    itl_budget_s: float | None = None,
) -> Decision:
    chunk = max(x.chunk, 1)
    ahead_s = _chunked_s(local, x.running, x.context, x.local_queue_tokens, chunk)[0] if x.local_queue_tokens else 0.0
    own_s, steps = _chunked_s(local, x.running, x.context, x.prompt_tokens, chunk)
    local_s = ahead_s + own_s
    stall_s = max(own_s - steps * local.decode_s(x.running, x.context), 0.0) if x.running else 0.0
    n = x.prompt_tokens - 1  # the prefill group computes all but the last prompt token
    remote_s = (
        remote.prefill_s(x.remote_queue_tokens + n)
        + remote.transfer_s(n)
        + overhead_s
        + 0.5 * local.decode_s(x.running, x.context)  # an idle engine (no step running) notices at once
        + local.step_s(x.running, x.context, 1)
    )
    if mode is PrefillPlacement.AUTO:
        is_local = local_s + x.running * stall_s <= remote_s
        # prompts queued here decode by the time its chunks run: they count as streams it would stall
        if is_local and (x.running or x.local_queue_tokens) and itl_budget_s is not None:
            is_local = local.step_s(max(x.running, 1), x.context, min(x.prompt_tokens, chunk)) <= itl_budget_s
    else:
        is_local = mode is PrefillPlacement.LOCAL
    return Decision(is_local, local_s, remote_s, stall_s)


class PlacementSpec(BaseModel):
    """Where a disaggregated decode group has its prompts prefilled (the cluster config's ``placement:``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: PrefillPlacement = Field(
        default=PrefillPlacement.REMOTE, description="remote (always a prefill group), local, or auto (per request)"
    )
    profile: Path | None = Field(
        default=None, description="this decode group's hardware profile (disagg bench engine --profile); auto needs it"
    )
    prefill_profile: Path | None = Field(default=None, description="the prefill groups' profile; None: the same")
    overhead_s: float = Field(
        default=0.02, ge=0, description="fixed cost of a remote prefill's round trip (the call, the notification)"
    )
    itl_budget_s: float | None = Field(
        default=None,
        gt=0,
        description="auto: while streams decode here (or prompts wait here), a prompt is prefilled here only if "
        "each of its chunk steps stays within this many seconds (the deployment's ITL / TPOT SLO); None: the cost "
        "rule alone",
    )
    local_max_tokens: int = Field(
        default=0,
        ge=0,
        description="a prompt with at most this many tokens past the decoder's prefix-cache hit is prefilled on the "
        "decode node in every mode (Dynamo's max_local_prefill_length): a warm chat turn's or another choice's "
        "last page moves nothing; 0: off",
    )

    @model_validator(mode="after")
    def _profile_for_auto(self) -> PlacementSpec:
        if self.mode is PrefillPlacement.AUTO and self.profile is None:
            raise ValueError("placement mode 'auto' needs a hardware profile (placement.profile)")
        return self

    def cost_models(self) -> tuple[CostModel, CostModel] | None:
        """(this group's, the prefill groups') curves; None when the mode does not use them."""
        if self.mode is not PrefillPlacement.AUTO:
            return None
        assert self.profile is not None
        local = CostModel(HardwareProfile.load(self.profile))
        remote = local if self.prefill_profile is None else CostModel(HardwareProfile.load(self.prefill_profile))
        return local, remote

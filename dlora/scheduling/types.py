"""Plain data the batching policies read and write: no vLLM, no tensors, no clock.

The engine integration (a vLLM `Scheduler` subclass) builds one `RequestView` per unfinished
request each step, asks the policy for a `Decision`, applies it (hides the requests not allowed,
merges or unmerges in-band with that step), and after the step reports an `IterationStats`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# The key the policies use for requests on the base model (no adapter). It is never merged.
BASE = None

AdapterKey = str | None  # an adapter name, or None (BASE) for the base model


class Mode(enum.Enum):
    UNMERGED = "unmerged"  # base weights; each request applies its own LoRA term (any mix)
    MERGED = "merged"  # one adapter folded into the weights; its requests run with no LoRA (others
    # only in mixed steps, compensated by their LoRA layers: `BatchingConfig.mixed_merged`)


class Switch(enum.Enum):
    """The weight change to apply before the step a `Decision` is for.

    UNMERGE is only issued from MERGED. MERGE is issued from UNMERGED, or from MERGED onto another
    adapter (the merge planner going from one slice to the next): the engine then restores the
    base weights and merges the new adapter before the same step. Alg. 1 never does the latter: it
    goes UNMERGE, then MERGE at a later step.
    """

    NONE = "none"
    MERGE = "merge"  # fold `Decision.merged_adapter` into the base weights
    UNMERGE = "unmerge"  # restore the base weights (the adapter merged before this step)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the policy knows about one unfinished request (vLLM `Request`, read-only)."""

    req_id: str
    adapter: AdapterKey  # LoRA name, or None for the base model
    arrival_time: float  # seconds, same clock as `now`
    num_prompt_tokens: int
    num_computed_tokens: int  # prompt + output tokens whose KV exists
    num_output_tokens: int
    running: bool  # admitted by the engine (holds KV); False while waiting
    max_tokens: int | None = None  # its output cap (None: unknown)
    # The engine priority its client (or the server, for batch work) gave it: lower is served first,
    # before arrival order (vLLM's priority scheduling); 0 for every online request by default.
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's answer for one engine step.

    Invariants (checked by `policies.check_decision`): MERGED has a `merged_adapter`, and every
    allowed request belongs to it unless the policy mixes (`BatchingConfig.mixed_merged`: the
    engine compensates the others); UNMERGED has none; `allowed_req_ids` is empty only when there
    are no requests. `allowed_req_ids` is in priority order (the engine may schedule fewer).
    """

    mode: Mode
    merged_adapter: str | None
    allowed_req_ids: tuple[str, ...]
    switch: Switch = Switch.NONE


@dataclass(frozen=True, slots=True)
class IterationStats:
    """Measured facts about the step that just ran, fed to `BatchingPolicy.observe`.

    `mode`/`merged_adapter` are what the engine actually ran: if a merge failed and the replica
    stayed unmerged, the engine reports UNMERGED and the policy adopts it.
    """

    mode: Mode
    merged_adapter: str | None
    num_requests: int  # requests the engine scheduled this step (<= len(allowed))
    iteration_time: float  # wall seconds of the whole step, switch included
    switch_time: float = 0.0  # seconds of it spent merging/unmerging (0 when no switch)
    num_tokens: int = 0  # tokens scheduled
    prefill_tokens: int = 0  # of them, prompt tokens (a request scheduled for more than one token)

    @property
    def compute_time(self) -> float:
        return max(0.0, self.iteration_time - self.switch_time)


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """Policy state for /metrics and logs."""

    policy: str
    mode: Mode
    merged_adapter: str | None
    num_switches: int
    alpha: float | None = None
    beta: float | None = None
    credits: dict[AdapterKey, float] = field(default_factory=dict)
    starving: frozenset[AdapterKey] = frozenset()
    switch_cost: float | None = None  # current estimate t_M, seconds
    # The merge planner's step lines (unmerged, merged: fixed s, s per prompt token, s per sequence)
    # and the slice it started last (adapter, predicted gain s, merged s), for step traces.
    planner: dict | None = None

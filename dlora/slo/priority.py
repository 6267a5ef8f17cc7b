"""SeaLLM's doubling-budget (DB) priority (§4.2, Algorithm 2): which requests a replica serves first.

Why: FCFS lets a long request block the short ones behind it (head-of-line blocking), and SeaLLM's
normalized latency (Eq. 1, `dlora.slo.attainment`) weighs every request of an adapter by 1/L̂_a.
The priority that minimizes it (SeaLLM Eq. 7, Theorems 1-2, the c-mu rule) is O_r = T'_r * L̂_r:
estimated remaining time times the adapter's average execution time, smallest first. Remaining
times are unknown, so SeaLLM gives each request a budget instead and uses its remainder:

    Q_0 = mu_a + sigma_a                 the adapter's mean + standard deviation
    O_r = Q_r * L̂_a                      Q_r = what is left of the request's current budget
    budget k (k = 0, 1, ...) = 2^k * Q_0, granted when budget k - 1 is used up

so with mu = 100 and sigma = 20 the budgets are 120, 240, 480, ... tokens, used up after 120,
360, 840, ... tokens in all. A request that outlives its adapter's profile sinks in priority each
time it exhausts a budget (a multi-level feedback queue whose quanta are per adapter), and a
request just granted a larger budget waits behind fresh short ones.

Units: tokens, not seconds. One base model serves every adapter, so a decode step costs the same
whatever the adapter, and an adapter's execution time is proportional to its output length; in
tokens the order is also unaffected by merged/unmerged speed. So mu_a and sigma_a are the mean and
(population) standard deviation of the adapter's output lengths (`LengthStats`, fed from the
router's `OutputLengthEstimator`: `dlora.cluster.estimators.output_lengths.length_stats`),
L̂_a = mu_a, and the budget is spent by output tokens generated (prompt tokens are not counted:
every adapter's requests prefill at the same per-token cost, and a waiting request has spent
nothing). Ties (equal O_r) go in arrival order, then by request id, so equal-profile adapters get
FCFS.

Preemptive: the order is recomputed before every step from each request's tokens so far, so a
request that exhausts its budget mid-run is overtaken at the next step.

Starvation (SeaLLM's per-service starvation threshold) composes with dLoRA's credits
(`dlora.scheduling.credits`) through one knob, `scheduling.t_starve`; this module implements only
the order. The credits must keep measuring how long an adapter's requests are held back from the
*FCFS* batch (B_fcfs), not from the first max_batch requests in this order: an adapter whose
requests this order pushes to the back never appears in a batch cut from this order, so it would
never earn credit and could wait forever. Measured against arrival order, an adapter held back
for any reason, by merging or by this order, earns one second of credit per second, becomes
starving once its credit exceeds t_starve, and is then served first (Alg. 3 lines 11-15), which is
SeaLLM's "serve the starved services first". The batching policy then runs the first max_batch
requests of this order where it ran B_fcfs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from dlora.slo.attainment import AdapterName


class Queued(Protocol):
    """What the order reads of a request (`dlora.scheduling.types.RequestView` has it)."""

    @property
    def req_id(self) -> str: ...
    @property
    def adapter(self) -> AdapterName: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def num_output_tokens(self) -> int: ...


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True, slots=True)
class LengthStats:
    """An adapter's output-length profile in tokens: mean mu_a and standard deviation sigma_a."""

    mean: float
    std: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"LengthStats.{name}={v!r}: must be a finite number of tokens >= 0")

    @classmethod
    def of(cls, lengths: Sequence[float]) -> LengthStats:
        """Mean and population standard deviation of `lengths` (SeaLLM's "average and standard
        variance"); ValueError when empty."""
        if not lengths:
            raise ValueError("LengthStats.of: no lengths")
        mean = sum(lengths) / len(lengths)
        var = sum((x - mean) ** 2 for x in lengths) / len(lengths)
        return cls(mean, math.sqrt(var))

    @property
    def initial_budget(self) -> float:
        """Q_0 = mu + sigma, at least one token (a budget of 0 would never be spent)."""
        return max(1.0, self.mean + self.std)

    @property
    def weight(self) -> float:
        """L̂_a in tokens, at least one (so a zero mean does not make every request equal)."""
        return max(1.0, self.mean)


def budget_level(generated: int, stats: LengthStats) -> int:
    """How many budgets a request with `generated` output tokens has used up (0: still its first)."""
    q0, level, spent_until = stats.initial_budget, 0, stats.initial_budget
    while generated >= spent_until:
        level += 1
        spent_until += q0 * 2**level
    return level


def remaining_budget(generated: int, stats: LengthStats) -> float:
    """Q_r: tokens left of the current budget. Budget k = 2^k * Q_0 ends after (2^(k+1) - 1) * Q_0
    tokens in all, so Q_r = (2^(k+1) - 1) * Q_0 - generated."""
    k = budget_level(generated, stats)
    return (2 ** (k + 1) - 1) * stats.initial_budget - generated


def priority(generated: int, stats: LengthStats) -> float:
    """O_r = Q_r * L̂_a (SeaLLM §4.2), in tokens squared; smaller is served first."""
    return remaining_budget(generated, stats) * stats.weight


def sort_key(arrival_time: float, generated: int, stats: LengthStats, req_id: str = "") -> tuple[float, float, str]:
    """A request's place in the DB order: (O_r, arrival time, request id), ascending."""
    return (priority(generated, stats), arrival_time, req_id)


def order_requests(requests: Iterable[Q], stats: Mapping[AdapterName, LengthStats], default: LengthStats) -> list[Q]:
    """`requests` in DB order; an adapter missing from `stats` is profiled by `default`."""
    return sorted(
        requests,
        key=lambda r: sort_key(r.arrival_time, r.num_output_tokens, stats.get(r.adapter, default), r.req_id),
    )

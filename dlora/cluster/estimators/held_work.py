"""What the requests a replica holds still take, simulated from sampled output lengths.

A running request's remaining output is unknown; its adapter's observed lengths (the router's
`OutputLengthEstimator`) longer than what it has generated say how it may go on, so one draw
picks one of them (SamuLLM samples its lengths the same way). A replica's held requests are then
run through the step simulation (`replica_sim.simulate_replica`): running requests first with
nothing to prefill, then the queue in arrival order (vLLM's order at equal priority), each
prefilling its context (a request moved in from elsewhere recomputes what it generated there).
The batch planner takes the same queue as its jobs (`dlora.batch.held_jobs`), so it can simulate
new lines after it, in the same batches.

Also here: the lengths of finished requests are a biased sample while long requests still run
(the short ones finish first, and one that stopped at its cap is only known to be longer), so
`planning_lengths` gives the batch planner a censoring-aware estimate (estimators/survival.py):
finished requests that ended by themselves are ends, cap hits and running requests are censored
at their lengths so far.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Collection, Mapping, Sequence

from dlora.cluster.estimators.output_lengths import LengthHistory
from dlora.cluster.estimators.replica_sim import simulate_replica
from dlora.cluster.estimators.survival import UNBOUNDED, Observation, quantile_lengths
from dlora.cluster.policy_views import AdapterName, RequestLoad
from dlora.cost.params import CostParams


def draw_remaining(r: RequestLoad, lengths: Sequence[int], rng: random.Random) -> int:
    """One draw of `r`'s remaining output tokens: a length from `lengths` (sorted) above what it
    has generated, at most its `max_tokens`, less what it has generated; its expected remainder
    when no length is above, or when the draw is `UNBOUNDED` and its cap is not known. At least 1."""
    first_longer = bisect.bisect_right(lengths, r.output_tokens)
    if first_longer < len(lengths):
        total = lengths[rng.randrange(first_longer, len(lengths))]
        if r.max_tokens is not None:
            return max(1, min(total, r.max_tokens) - r.output_tokens)
        if total != UNBOUNDED:
            return total - r.output_tokens
    return max(1, round(r.remaining_output_tokens))


def engine_order(reqs: Sequence[RequestLoad], moved_in: Collection[str] = ()) -> list[tuple[RequestLoad, int]]:
    """`reqs` held by one replica in the order its engine runs them, each with the tokens it has
    to prefill: running ones first (nothing), not `moved_in`; then the queued and moved-in ones by
    arrival (their context)."""
    running = [(r, 0) for r in reqs if r.running and r.request_id not in moved_in]
    queued = sorted((r for r in reqs if not r.running or r.request_id in moved_in), key=lambda r: r.arrival)
    return running + [(r, r.context_tokens) for r in queued]


def finish_times(
    reqs: Sequence[RequestLoad], left: Mapping[str, int], p: CostParams, moved_in: Collection[str] = ()
) -> list[float]:
    """Finish time of each of `reqs` held by one replica, in `engine_order`, `left` giving each
    one's remaining output."""
    order = engine_order(reqs, moved_in)
    return simulate_replica([n for _, n in order], [left[r.request_id] for r, _ in order], p)


def planning_lengths(history: LengthHistory, running: Sequence[RequestLoad]) -> dict[AdapterName, list[int]]:
    """Each adapter's output lengths for the batch planner: `QUANTILES` equal-mass quantiles of a
    Kaplan-Meier estimate over its finished requests (`history`) and its running ones, censored at
    what they have generated. An adapter with fewer than `min_samples` finished ones of its own is
    estimated from every adapter's, finished and running alike (left out, the running ones would
    leave the pool to the short requests that finished first).
    `UNBOUNDED` where the mass lies past every end seen (the consumer caps it at a request's
    `max_tokens`)."""
    censored: dict[AdapterName, list[Observation]] = {}
    for r in running:
        if r.output_tokens > 0:
            censored.setdefault(r.adapter, []).append((r.output_tokens, False))
    pooled: list[int] | None = None
    out = {}
    for a in set(history.own) | set(censored):
        if history.uses_own(a):
            out[a] = quantile_lengths([*history.own[a], *censored.get(a, ())])
            continue
        if pooled is None:
            pooled = quantile_lengths([*history.pooled, *(o for obs in censored.values() for o in obs)])
        out[a] = pooled
    return out

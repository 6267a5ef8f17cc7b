"""Output lengths with censoring: a Kaplan-Meier estimate, sampled as equal-mass quantiles.

Why: the lengths a planner sees mid-run are biased short. A request that stopped at its
`max_tokens` ("length") says only that its own length is longer than the cap, and a request still
running says only that it is longer than what it has generated so far. Counting the first at its
cap and leaving the second out (or guessing its end from the short ones that have finished)
predicts too little work: on a batch whose lines either stop early or run to their cap, half the
makespan. Kaplan-Meier counts each such request as censored: it was at risk up to its length and
then left the sample without an end.

    S(t) = prod over end lengths t_j <= t of (1 - d_j / n_j)

where d_j requests ended at t_j and n_j had at least t_j tokens then (ended at or after t_j, or
censored at or after it). The mass past the last end, S(t_last), belongs to requests that nobody
has seen end: a draw from it is `UNBOUNDED`, which the consumer caps at each request's
`max_tokens` (a line capped like the censored ones runs exactly to its cap).

The planner samples lengths uniformly from a list (`dlora.batch.predict.sample_lengths`), so the
estimate is handed over as `QUANTILES` equal-mass quantiles. Pure Python, no clock.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence

# A length past every observed end: the request runs to its own max_tokens.
UNBOUNDED = 2**31 - 1
QUANTILES = 256

# (length, ended): ended is False for a request that hit its cap or is still running.
Observation = tuple[int, bool]


def survival(observations: Iterable[Observation]) -> list[tuple[int, float]]:
    """Kaplan-Meier: (t_j, S(t_j)) at each length t_j where a request ended, ascending."""
    ends: Counter[int] = Counter()
    leaves: Counter[int] = Counter()  # ended or censored, at each length
    for length, ended in observations:
        leaves[length] += 1
        if ended:
            ends[length] += 1
    at_risk = sum(leaves.values())
    s, out = 1.0, []
    for t in sorted(leaves):
        if ends[t]:
            s *= 1.0 - ends[t] / at_risk
            out.append((t, s))
        at_risk -= leaves[t]  # a request censored at t was still at risk at t
    return out


def quantile_lengths(observations: Sequence[Observation], n: int = QUANTILES) -> list[int]:
    """`n` equal-mass quantiles (midpoints) of the Kaplan-Meier distribution, ascending; those in
    the mass nobody was seen to end within are `UNBOUNDED`. Empty when there are no observations."""
    if not observations:
        return []
    curve = survival(observations)
    cdf = [1.0 - s for _, s in curve]
    out = []
    for i in range(n):
        q = (i + 0.5) / n
        j = bisect.bisect_left(cdf, q)
        out.append(curve[j][0] if j < len(curve) else UNBOUNDED)
    return out

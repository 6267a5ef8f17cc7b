"""A request's isolated execution time: how long it takes on a replica with nothing else to do.

SeaLLM measures latency against it: the normalized latency (Eq. 1) divides a request's latency by
its service's average isolated execution time L̂_s, and the evaluation's SLO is 5x the execution
time. With one base model every adapter has the same per-token cost, so the isolated time follows
from the replica's step-time model (`dlora.cost.params.CostParams`) and the
request's lengths:

    TTFT_iso = per_iteration_s + per_prefill_token_s * prompt_tokens    (one prefill step)
    TPOT_iso = per_iteration_s + per_decode_token_s                      (a decode step of batch 1)
    L_iso    = TTFT_iso + (output_tokens - 1) * TPOT_iso

Unmerged cost (the LoRA term applied per request) is used: that is how a request of any adapter
runs when it is alone and the replica does not merge for it.

A cluster prices isolation with the mean of its replicas' coefficients (`mean_params`): the times
above are linear in them, so that is the replicas' mean isolated time, and a request's isolated time
does not depend on which replica it happened to run on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dlora.cost.params import CostParams, step_seconds

# The coefficients isolated times are made of (what `mean_params` averages and the admin API shows).
ISOLATED_COEFFICIENTS = ("per_iteration_s", "per_decode_token_s", "per_prefill_token_s")


@dataclass(frozen=True, slots=True)
class IsolatedTimes:
    """The TTFT and the time per output token of one request running alone."""

    ttft_s: float
    tpot_s: float

    def execution_s(self, output_tokens: int) -> float:
        """End-to-end time of a request with `output_tokens` outputs: the first token comes with the
        prefill, each further one costs one decode step."""
        return self.ttft_s + max(0, output_tokens - 1) * self.tpot_s


def isolated_times(params: CostParams, prompt_tokens: int) -> IsolatedTimes:
    """The isolated TTFT and TPOT of a request with `prompt_tokens` on a replica priced by `params`."""
    return IsolatedTimes(
        ttft_s=params.per_iteration_s + params.per_prefill_token_s * max(0, prompt_tokens),
        tpot_s=step_seconds(params, 1),
    )


def mean_params(params: Sequence[CostParams]) -> CostParams:
    """The replicas' coefficients averaged (the rest taken from the first): isolated times computed
    from it are the mean of the replicas' isolated times. With no replica, the priors."""
    if not params:
        return CostParams()
    means = {name: sum(getattr(p, name) for p in params) / len(params) for name in ISOLATED_COEFFICIENTS}
    return dataclasses.replace(params[0], **means)

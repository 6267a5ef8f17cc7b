"""The coefficients of the step-time model that dispatch, SLOs, batch plans and simulators price work with.

A step of continuous batching costs roughly

    t(step) = per_iteration_s + per_decode_token_s * decode_tokens + per_prefill_token_s * prefill_tokens

and a step that runs merged costs `merged_ratio` of that. The router fits these coefficients per
replica (`dlora.cluster.estimators.replica_cost`); a request's isolated time (`dlora.slo.isolated`),
the batch planner and the simulators read them. A leaf module (no dlora imports) because the SLO
policies, which sit below the cluster, price requests with them too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Merged step cost over unmerged until merged steps are measured: a GPU-shaped prior (the triton
# backend's); the server passes its LoRA backend's (dlora.scheduling.config.MERGED_COST_PRIORS).
MERGED_RATIO_PRIOR = 0.6


@dataclass(frozen=True, slots=True)
class CostParams:
    """Coefficients of the step-time model (priors: a tiny Llama on one CPU core)."""

    per_iteration_s: float = 0.004  # fixed cost of a step: scheduling, sampling, Python
    per_decode_token_s: float = 0.001  # marginal cost of one more sequence in a decode step
    per_prefill_token_s: float = 0.0002  # cost of one prompt (or re-prefilled) token
    merged_ratio: float = MERGED_RATIO_PRIOR  # merged step cost / unmerged step cost
    # add_lora (~3 ms) + an actor round trip, rounded up; replaced by the replica's measured loads
    adapter_load_s: float = 0.02
    max_batch: int = 32  # sequences per step (vLLM max_num_seqs)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"CostParams.{f.name} must be >= 0")
        if self.max_batch < 1:
            raise ValueError("CostParams.max_batch must be >= 1")


def step_seconds(p: CostParams, batch: int) -> float:
    """Wall time of one decode step of `batch` sequences."""
    return p.per_iteration_s + p.per_decode_token_s * max(1, min(batch, p.max_batch))

"""The step line as the router, SLOs, batch plans and simulators price requests with it.

A step of continuous batching costs `line` (`dlora.cost.line.StepLine`):

    t(step) = per_iteration_s + per_decode_token_s * decode_tokens + per_prefill_token_s * prefill_tokens

and a step that runs merged costs `merged_ratio` of that; an adapter load costs `adapter_load_s`.
The router fits these per replica (`dlora.cluster.estimators.replica_cost`); a request's isolated
time (`dlora.slo.isolated`), the batch planner and the simulators read them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dlora.cost.line import StepLine

# Merged step cost over unmerged until merged steps are measured, where the LoRA backend is not
# known: a GPU-shaped prior (the triton backend's).
MERGED_RATIO_PRIOR = 0.6
# How much cheaper a merged step is than an unmerged one of the same size, per LoRA backend, until
# both are measured. A prior far below the truth makes Alg. 2 lower alpha on imagined merged speed
# and pay real switches to learn otherwise (8 rank-8 q/k/v/o adapters, SmolLM2-135M bf16, 1 core):
#   vllm:   vLLM's CPU LoRA ops make unmerged decode ~2.5-3x slower than merged;
#   einsum: live-rank packing + oneDNN GEMMs leave unmerged 1.14-1.25x a base-model step
#           (16 decodes, in-engine); a 0.4 prior makes 4 needless switches at uniform
#           popularity in bench/dynamic_batching_skew;
#   triton: a GPU-shaped default (merged at 0.6 of unmerged cost).
MERGED_COST_PRIORS = {"vllm": 0.4, "einsum": 0.85, "triton": MERGED_RATIO_PRIOR}


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

    @property
    def line(self) -> StepLine:
        """The unmerged step line: a step's fixed cost, per prompt token and per decoded sequence."""
        return StepLine(self.per_iteration_s, self.per_prefill_token_s, self.per_decode_token_s)


def step_seconds(p: CostParams, batch: int) -> float:
    """Wall time of one decode step of `batch` sequences."""
    return p.per_iteration_s + p.per_decode_token_s * max(1, min(batch, p.max_batch))

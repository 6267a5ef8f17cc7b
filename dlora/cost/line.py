"""One step of continuous batching, priced as a line in its work.

    t(step) = fixed_s + per_prefill_token_s · prompt tokens computed + per_seq_s · sequences

Every step-time estimate in dlora is this line or a sum of them: the engine's merge planner keeps
one per weight state, the router prices a replica's requests with one (`CostParams.line`, its
fixed cost shared by a full batch), and the simulators produce step times from one for the base
model plus one for the LoRA term (`dlora.sim.step_costs.StepCosts`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepLine:
    """Seconds of a step: fixed + per_prefill_token · prompt tokens + per_seq · sequences."""

    fixed_s: float
    per_prefill_token_s: float
    per_seq_s: float

    def seconds(self, prefill_tokens: float, seqs: float) -> float:
        return self.fixed_s + self.per_prefill_token_s * prefill_tokens + self.per_seq_s * seqs

    def scaled(self, factor: float) -> StepLine:
        return StepLine(self.fixed_s * factor, self.per_prefill_token_s * factor, self.per_seq_s * factor)

    def coefficients(self) -> tuple[float, float, float]:
        """(fixed, per prompt token, per sequence): the order `dlora.cost.fit` solves them in."""
        return self.fixed_s, self.per_prefill_token_s, self.per_seq_s

"""How long one engine step takes in the replica simulator: a linear model per weight state.

    t(step) = fixed + per_seq * sequences + per_prefill_token * prompt tokens prefilled
              (+ per_adapter * distinct adapters, unmerged only)

Merged steps (one adapter folded into the weights, its requests run with no LoRA term) use the
base-model coefficients; unmerged steps pay the LoRA term. Switches cost `merge_cold_s` for an
adapter whose merged weights are not cached, `merge_cached_s` for one that is (the worker keeps
`merged_cache_entries` adapters' merged kernels, LRU), and `unmerge_s`.

The presets are fitted to measured steps, so policies can be compared without the machine's
noise (and with it, through `noise_sd`):
- `cpu-einsum`: SmolLM2-135M bf16, one core, dlora's einsum LoRA kernels, 8 rank-8 q/k/v/o
  adapters; least squares over ~6,000 traced decode and prefill steps of the skew benchmark
  (`DLORA_STEP_TRACE`): unmerged 42 + 2.2 n ms + 1.56 ms per prompt token, merged
  36.6 + 2.1 n ms + 1.31 ms per prompt token; switches timed in-process (cold merge 130-210 ms
  through vLLM's reload, cached merge 1.3 ms, unmerge 1.6 ms).
- `cpu-vllm-ops`: the same model with vLLM's own CPU LoRA ops, whose unmerged decode steps cost
  2.5-3x a merged one (a skew-benchmark run with that backend: TPOT 145-155 ms unmerged vs
  54-59 ms merged; this preset gives 165-175 ms per output token unmerged where that run measured
  143-161).
- `gpu-like`: a GPU-shaped regime: merged at 0.6 of unmerged cost, a 20 ms switch.

Other step-time models, and why this one differs: `dlora.scheduling.cost_model` is fitted inside
the engine, online, per weight state over batch size only (what Alg. 2 compares), and
`dlora.cluster.estimators.cost_model` is the router's per-replica fit of per-step, per-decode-token
and per-prefill-token seconds, summed per request so the co-migration ILP stays linear. Both learn
from measured steps; a simulator must instead *produce* step times from fixed coefficients, with
the LoRA term and switch costs separate, so this model is given, not fitted.
`migration_bound.ReplicaModel.cost_params` turns it into the router's `CostParams`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    fixed_s: float
    per_seq_s: float
    per_prefill_token_s: float
    lora_fixed_s: float  # extra per unmerged step with any adapter token (the LoRA layers' calls)
    lora_per_seq_s: float  # extra per adapter sequence in an unmerged step
    lora_per_prefill_token_s: float
    lora_per_adapter_s: float = 0.0  # extra per distinct adapter in an unmerged step
    merge_cold_s: float = 0.15
    merge_cached_s: float = 0.0015
    unmerge_s: float = 0.0015
    merged_cache_entries: int = 8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"StepCosts.{f.name} must be >= 0")

    def step(self, seqs: int, prefill_tokens: int, lora_seqs: int, lora_prefill_tokens: int, adapters: int) -> float:
        """Seconds of one step: `lora_*` count the sequences and prompt tokens that apply a LoRA
        term (none while their adapter is merged), `adapters` the distinct adapters among them."""
        t = self.fixed_s + self.per_seq_s * seqs + self.per_prefill_token_s * prefill_tokens
        if lora_seqs:
            t += (
                self.lora_fixed_s
                + self.lora_per_seq_s * lora_seqs
                + self.lora_per_prefill_token_s * lora_prefill_tokens
                + self.lora_per_adapter_s * adapters
            )
        return t


PRESETS: dict[str, StepCosts] = {
    "cpu-einsum": StepCosts(
        fixed_s=0.0366,
        per_seq_s=0.0021,
        per_prefill_token_s=0.00131,
        lora_fixed_s=0.0054,
        lora_per_seq_s=0.0001,
        lora_per_prefill_token_s=0.00025,
        merge_cold_s=0.17,
        merge_cached_s=0.0013,
        unmerge_s=0.0016,
    ),
    "cpu-vllm-ops": StepCosts(
        fixed_s=0.0366,
        per_seq_s=0.0021,
        per_prefill_token_s=0.00131,
        lora_fixed_s=0.045,
        lora_per_seq_s=0.002,
        lora_per_prefill_token_s=0.0015,
        lora_per_adapter_s=0.001,
        merge_cold_s=0.13,
        merge_cached_s=0.0013,
        unmerge_s=0.0013,
    ),
    "gpu-like": StepCosts(
        fixed_s=0.012,
        per_seq_s=0.0002,
        per_prefill_token_s=0.00003,
        lora_fixed_s=0.006,
        lora_per_seq_s=0.0002,
        lora_per_prefill_token_s=0.00002,
        lora_per_adapter_s=0.0004,
        merge_cold_s=0.02,
        merge_cached_s=0.02,
        unmerge_s=0.02,
    ),
}


def preset(name: str) -> StepCosts:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown step-cost preset {name!r}: choose from {', '.join(PRESETS)}") from None

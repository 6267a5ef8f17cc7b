"""Parameters of the batching policies (dLoRA §4.2, Algorithms 1–3).

Units: thresholds are ratios |R_merge| / |B_fcfs| in (0, 1]; credits are seconds (an adapter
earns one second of credit per second its FCFS-due requests are held back, see credits.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dlora.cost.params import MERGED_COST_PRIORS
from dlora.cost.params import MERGED_RATIO_PRIOR as DEFAULT_MERGED_COST_RATIO
from dlora.kinds import kind_error

# Bounds the tuned thresholds stay inside. The ratio is at most 1, so alpha = 1.0 means "never merge"
# (the test is strict) yet Alg. 2 can still lower it again from the hypothetical merged throughput.
ORDERS = ("fcfs", "seallm")  # service orders of the dlora policy (`order`)
THRESHOLD_MIN = 0.05
THRESHOLD_MAX = 1.0

# The einsum kernels' unmerged step over a merged one grows with the adapters' size, as
# 1 + FIXED + PER_FRACTION x lora_fraction (LoRA multiply-adds over the base projections',
# `BaseModelShapes.lora_fraction`). Two anchors on SmolLM2-135M, one core per replica: rank 8 on
# q/k/v/o (fraction 0.009) at the 0.85 above; rank 64 on all seven (0.18), where a batch over 16
# adapters sent unmerged took 1.93x as long as the same requests on the base model (bench/batch,
# `plan_gain_bound`). Read as a prior: measured merged steps replace it.
EINSUM_UNMERGED_FIXED = 0.14
EINSUM_UNMERGED_PER_FRACTION = 4.3


def einsum_merged_cost(lora_fraction: float) -> float:
    """Prior merged/unmerged step cost with the einsum kernels for adapters of `lora_fraction`."""
    return 1.0 / (1.0 + EINSUM_UNMERGED_FIXED + EINSUM_UNMERGED_PER_FRACTION * max(0.0, lora_fraction))


def _require(cond: bool, name: str, value: object, why: str) -> None:
    if not cond:
        raise ValueError(f"scheduling.{name}={value!r}: {why}")


@dataclass(frozen=True)
class BatchingConfig:
    # The FCFS batch size max_bs of Alg. 1/3: at most this many requests are allowed per step.
    # Set it to the engine's max_num_seqs. `decide(..., max_batch=)` overrides it per call.
    max_batch: int = 64
    # Alg. 1 switching thresholds, initial values (Alg. 2 tunes them at break points).
    # The artifact starts alpha at 1.0 (with >=) and beta at merge/unmerge iteration time 0.556.
    alpha: float = 0.9  # unmerged -> merged when ratio > alpha
    beta: float = 0.6  # merged -> unmerged when ratio < beta
    # Alg. 2 steps (the dLoRA artifact's AIMD constants): merged wins -> threshold - gamma_dec,
    # unmerged wins -> threshold * gamma_mul.
    gamma_dec: float = 0.05
    gamma_mul: float = 1.1
    min_threshold_gap: float = 0.05  # keep beta <= alpha - gap so a switch is never undone at once
    # Alg. 2 break point "after processing a set number of iterations" N.
    break_period_iters: int = 32
    # Initial switching-cost estimate t_M (a GPU-shaped 0.02 s switch); replaced by measurements.
    switch_cost_s: float = 0.02
    # Prior merged/unmerged iteration-time ratio at equal batch size, used for the mode not yet
    # measured. None: the engine's LoRA backend's (`MERGED_COST_PRIORS`); DEFAULT_MERGED_COST_RATIO
    # (merged batches modelled at 0.6 of unmerged cost) where no backend is known.
    merged_cost_ratio: float | None = None
    # Alg. 3 credits (seconds). Every adapter (and the base model) starts with initial_credit.
    initial_credit: float = 1.0
    min_credit_to_merge: float = 0.0  # merge only if credit - this step's cost >= this (line 17)
    t_starve: float = 2.0  # credit > t_starve -> starving: served first (lines 6-15)
    t_normal: float = 1.5  # a starving adapter is normal again once credit < t_normal
    # Not in the paper: credit relaxes toward initial_credit at this rate (credit/s), except for
    # adapters being held back (see credits.py). 0 gives the paper's closed ledger, where a hot
    # adapter that spent its credit regains it only when starving adapters are served ahead of it.
    credit_relax_per_s: float = 0.5
    # `dlora`, not in the paper: also merge an adapter when the merge planner (merge_planner.py) predicts
    # that serving its queued work merged, then the rest unmerged, finishes the replica's known work
    # sooner than serving it all unmerged, by more than `planner_margin` of the merged slice's time
    # (and stay merged while that holds). Alg. 1's threshold rule still applies beside it.
    merge_planner: bool = True
    planner_margin: float = 0.1
    # `dlora`: the order requests are served in: "fcfs" (dLoRA's) or "seallm" (SeaLLM's preemptive
    # doubling-budget priority, dlora/slo/priority.py: short requests of adapters with short outputs
    # first). Credits (Alg. 3) measure against FCFS either way, so t_starve bounds every wait.
    order: str = "fcfs"
    # MuxServe's per-adapter KV quotas in each engine (dlora/engine_ext/kv_quotas.py): an adapter's
    # share of the KV blocks follows its request rate over the last `kv_quota_period_s`, unused quota
    # is lent, and when blocks are short the borrowers' requests wait (and are preempted) first.
    kv_quotas: bool = False
    kv_quota_period_s: float = 10.0
    # `merged` baseline: the longest stay (iterations) on one adapter while other requests wait.
    merged_max_iters: int = 256
    # `dlora`: while an adapter is merged, the other requests run in the same step, their LoRA
    # layers compensating the merged delta (see dynamic_batching.py), so nobody waits for an
    # unmerge. Only dlora's LoRA backends can compensate: the engine turns it off on `vllm`'s.
    mixed_merged: bool = False
    # Not in the paper: seconds a request may wait for a LoRA batch slot (vLLM's max_loras, all
    # taken by other adapters) before one running adapter is drained for it (lora_slots.py).
    # None (default): vLLM's rule, which lets a cold adapter wait as long as the hot ones keep
    # arriving. Off by default because draining holds back the drained adapter's newer requests
    # for as long as its running ones take: with ~200-token outputs that raised proactive
    # dispatch's mean queueing 1.4-3.6x (bench/cluster_balancing/runs/2026-11-24-sharegpt-eos-slot-aging-ablation.json).
    lora_slot_starve_s: float | None = None

    @property
    def merged_cost_prior(self) -> float:
        return DEFAULT_MERGED_COST_RATIO if self.merged_cost_ratio is None else self.merged_cost_ratio

    def for_lora_backend(self, backend: str) -> BatchingConfig:
        """The config as an engine with LoRA `backend` runs it: an unset merged_cost_ratio becomes
        the backend's prior, and mixing is off with vLLM's ops (they cannot compensate)."""
        changes: dict = {}
        if self.merged_cost_ratio is None:
            changes["merged_cost_ratio"] = MERGED_COST_PRIORS.get(backend, DEFAULT_MERGED_COST_RATIO)
        if backend == "vllm":
            changes["mixed_merged"] = False
        return dataclasses.replace(self, **changes) if changes else self

    def __post_init__(self) -> None:
        why = kind_error(self, "scheduling")
        if why:
            raise ValueError(why)
        _require(self.max_batch >= 1, "max_batch", self.max_batch, "must be >= 1")
        _require(
            0 < self.beta < self.alpha <= THRESHOLD_MAX,
            "alpha",
            (self.alpha, self.beta),
            f"need 0 < beta < alpha <= {THRESHOLD_MAX}",
        )
        _require(self.gamma_dec > 0, "gamma_dec", self.gamma_dec, "must be > 0")
        _require(self.gamma_mul > 1, "gamma_mul", self.gamma_mul, "must be > 1")
        _require(
            0 <= self.min_threshold_gap < THRESHOLD_MAX,
            "min_threshold_gap",
            self.min_threshold_gap,
            f"must be in [0, {THRESHOLD_MAX})",
        )
        _require(self.break_period_iters >= 1, "break_period_iters", self.break_period_iters, "must be >= 1")
        _require(self.switch_cost_s >= 0, "switch_cost_s", self.switch_cost_s, "must be >= 0")
        _require(
            self.merged_cost_ratio is None or self.merged_cost_ratio > 0,
            "merged_cost_ratio",
            self.merged_cost_ratio,
            "must be > 0 (or unset: the LoRA backend's prior)",
        )
        _require(self.t_normal < self.t_starve, "t_normal", self.t_normal, f"must be < t_starve ({self.t_starve})")
        _require(
            self.initial_credit < self.t_normal,
            "initial_credit",
            self.initial_credit,
            f"must be < t_normal ({self.t_normal}): credit relaxes toward it, and a starving "
            "adapter must be able to fall back under t_normal",
        )
        _require(
            self.min_credit_to_merge <= self.initial_credit,
            "min_credit_to_merge",
            self.min_credit_to_merge,
            f"must be <= initial_credit ({self.initial_credit})",
        )
        _require(self.credit_relax_per_s >= 0, "credit_relax_per_s", self.credit_relax_per_s, "must be >= 0")
        _require(self.kv_quota_period_s > 0, "kv_quota_period_s", self.kv_quota_period_s, "must be > 0")
        _require(self.order in ORDERS, "order", self.order, f"must be one of {', '.join(ORDERS)}")
        _require(self.planner_margin >= 0, "planner_margin", self.planner_margin, "must be >= 0")
        _require(self.merged_max_iters >= 1, "merged_max_iters", self.merged_max_iters, "must be >= 1")
        starve = self.lora_slot_starve_s
        _require(
            starve is None or starve >= 0,
            "lora_slot_starve_s",
            starve,
            "must be a number of seconds >= 0 (or null: never drain a slot)",
        )

"""SLO-aware serving configurations compared in the replica model (`migration_bound`), and
Aladdin's cost metric: the fewest replicas that reach an attainment target at a given rate.

Why a model: bench/slo runs the three configurations on two real replicas, where a CV-3 burst
fills both at once and dispatch has little to choose from; here the same policy code runs over
8, 32 or any number of modelled replicas, noise-free, in seconds.

`CONFIGS` are bench/slo's three configurations, as `SloConfig`s the model runs:
- `fcfs`: dLoRA's proactive dispatch (least pending time), admission in arrival order;
- `seallm`: the same with SeaLLM's doubling-budget order;
- `seallm_aladdin_quotas`: SeaLLM's order, Aladdin's SLO-feasible dispatch and MuxServe's KV quotas
  (re-adapted every 5 s, as bench/slo configures them).
Every request is held to the default SLO, SeaLLM's relative one (5 x its isolated TTFT and time
per output token, from the model's `CostParams`).

`report` turns one run into bench/slo's numbers (SLO attainment overall and of the coldest adapter,
SeaLLM's mean normalized latency, TTFT p50/p99) plus MuxServe's fairness gap, here the mean over
every replica's period-boundary samples. `replicas_for` searches the replica count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dlora.bench.adapter_slo import slo_summary
from dlora.sim.migration_bound import Outcome, ReplicaModel, TraceRequest, simulate
from dlora.slo.config import SloConfig

CONFIGS: dict[str, SloConfig] = {
    "fcfs": SloConfig(),
    "seallm": SloConfig(order="seallm"),
    "seallm_aladdin_quotas": SloConfig(order="seallm", dispatch="slo_feasible", kv_quotas=True, quota_period_s=5.0),
}


def report(jobs: Sequence[TraceRequest], outcome: Outcome) -> dict[str, Any]:
    """bench/slo's per-run numbers for `outcome`, a run of `jobs` (every job finishes in the model)."""
    assert outcome.slo is not None  # `simulate` always judges its jobs
    slo = slo_summary(outcome.slo, Counter(j.adapter for j in jobs), None)
    ttft_ms = 1000 * np.asarray(outcome.ttft_s)
    gaps = outcome.fairness_gaps
    return {
        "slo_attainment": slo["slo_attainment"],
        "slo_attainment_coldest_adapter": slo["slo_attainment_coldest_adapter"],
        "coldest_adapter": slo["coldest_adapter"],
        "normalized_latency": slo["normalized_latency"],
        "median_ttft_ms": float(np.percentile(ttft_ms, 50)) if len(ttft_ms) else None,
        "p99_ttft_ms": float(np.percentile(ttft_ms, 99)) if len(ttft_ms) else None,
        "kv_fairness_gap_mean": sum(gaps) / len(gaps) if gaps else None,
        "preemptions": outcome.preemptions,
        "infeasible_dispatches": outcome.infeasible_dispatches,
        "per_adapter": {a: {k: v for k, v in m.items() if k != "slo"} for a, m in slo["per_adapter"].items()},
    }


def run(jobs: Sequence[TraceRequest], replicas: int, model: ReplicaModel, slo: SloConfig) -> dict[str, Any]:
    """`jobs` dispatched at arrival over `replicas` modelled replicas under `slo`, reported."""
    return report(jobs, simulate(jobs, replicas, model, "at_arrival", slo=slo))


def replicas_for(
    traces: Sequence[Sequence[TraceRequest]],
    model: ReplicaModel,
    slo: SloConfig,
    target: float = 0.99,
    start: int = 1,
    most: int = 256,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[int | None, dict[int, float]]:
    """The fewest replicas (at most `most`) whose SLO attainment, the mean over `traces` (workload
    seeds at one rate), reaches `target`, and the attainment of every count tried (each also
    passed to `progress`); None when even `most` fall short.

    From `start` (a guess, e.g. the count the jobs' rate would saturate), doubles while counts fall
    short or halves while they reach the target, then bisects between the last count that fell
    short and the first that reached it. That takes attainment as non-decreasing in the replica
    count, which holds up to the noise of where requests happen to land: the answer is the fewest
    within the final bracket, not a proof that no smaller count reaches the target."""
    if not 1 <= start <= most:
        raise ValueError(f"start={start!r}: must be in [1, most={most}]")
    tried: dict[int, float] = {}

    def reaches(n: int) -> bool:
        if n not in tried:
            tried[n] = sum(run(jobs, n, model, slo)["slo_attainment"] or 0.0 for jobs in traces) / len(traces)
            if progress is not None:
                progress(n, tried[n])
        return tried[n] >= target

    hi = start
    if reaches(hi):
        lo = hi // 2  # 0 replicas never reach it
        while lo and reaches(lo):
            hi, lo = lo, lo // 2
    else:
        lo = hi
        while not reaches(hi):
            if hi == most:
                return None, tried
            lo, hi = hi, min(2 * hi, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi, tried

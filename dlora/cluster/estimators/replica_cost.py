"""Per-replica cost model: how many seconds of engine work a replica has outstanding.

Dispatch (§5.1 of the dLoRA paper) compares replicas by *estimated pending time*, and the
co-migration ILP (§5.2) balances the same quantity, so both read it from here. A step of
continuous batching costs roughly

    t(step) = per_iteration_s + per_decode_token_s * decode_tokens + per_prefill_token_s * prefill_tokens

so a request's remaining work is its unprefilled prompt times the prefill cost plus its remaining
output times the decode cost, with the per-step overhead shared by a full batch (`max_batch`).
Counting every request at full-batch cost makes its work independent of what else runs on the
replica, so pending time is additive and the ILP stays linear; it underestimates the latency of a
nearly idle replica, which is harmless because load balancing only matters when replicas are busy.
Requests of the replica's merged adapter run at `merged_ratio` (the LoRA backend's prior,
refitted from merged steps) of that. A request whose adapter would find every batch slot (vLLM's max_loras) taken also
waits for one (`batch_slot_wait`). The coefficients start from priors and are refitted from the
replica's measured steps (`IterationSample`) by least squares pulled towards the priors, so one
step size seen so far cannot produce a wild fit (`dlora.cost.fit`, as every step-time fit in
dlora). The coefficients themselves are `dlora.cost.params.CostParams`.

Other step-time models, and why this one differs: `dlora.scheduling.iteration_time` runs inside each
engine and prices a whole step per weight state over batch size (Alg. 2 compares two batches);
`dlora.sim.step_costs` holds the simulators' fixed coefficients. The router sees only the steps a
replica reports and needs each request's work on its own, additive, so the ILP stays linear: hence
per-token coefficients with the step overhead shared by a full batch.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from dlora.cluster.policy_views import AdapterName, IterationSample, ReplicaView, RequestLoad
from dlora.cost.fit import fit_nonnegative
from dlora.cost.params import CostParams, step_seconds

MIN_SAMPLES = 8  # steps needed before the fit replaces the priors
MIN_MERGED_SAMPLES = 3
RATIO_FLOOR = 0.05  # the least merged/unmerged ratio believed (a merged step is not free)
RIDGE = 1e-3  # prior weight relative to the samples' (see _fit_linear)
# Weight of the newest adapter load in the load-time average: a few loads move it, so a replica
# whose loads grew (larger adapters, a busier disk) is priced by them within a handful of loads.
LOAD_EWMA_WEIGHT = 0.3


def request_work(p: CostParams, req: RequestLoad, merged: bool = False) -> float:
    """Seconds of engine time `req` still needs on a replica (merged: its adapter is folded in).

    A request the engine has not admitted yet prefills its whole context first (a moved one also
    what it generated elsewhere); an admitted one's prefill counts as done (a step or so away)."""
    prefill = 0 if req.running else req.prompt_tokens + req.output_tokens
    per_token = p.per_decode_token_s + p.per_iteration_s / p.max_batch
    work = prefill * p.per_prefill_token_s + req.remaining_output_tokens * per_token
    return work * p.merged_ratio if merged else work


def prefill_saved(p: CostParams, req: RequestLoad, replica_id: int, merged: bool = False) -> float:
    """Seconds of `request_work` that `replica_id` would skip: the prompt tokens its prefix cache
    probably holds for `req` (`RequestLoad.cached_prefix`), which vLLM does not compute again."""
    if req.running:
        return 0.0
    saved = req.cached_on(replica_id) * p.per_prefill_token_s
    return saved * p.merged_ratio if merged else saved


def recompute_s(p: CostParams, req: RequestLoad, replica_id: int | None = None) -> float:
    """Extra seconds a migration costs the target (`replica_id`): a running request's KV is rebuilt
    by prefill, less the prompt prefix that target's cache probably holds."""
    if not req.running:
        return 0.0
    cached = 0 if replica_id is None else req.cached_on(replica_id)
    return (req.context_tokens - cached) * p.per_prefill_token_s


def pending_time(p: CostParams, view: ReplicaView) -> float:
    """Seconds of queued + running work on the replica (the load dispatch and the ILP balance)."""
    merged = view.merged_adapter
    return sum(request_work(p, r, merged is not None and r.adapter == merged) for r in view.requests)


def merge_disruption(p: CostParams, view: ReplicaView, adapter: AdapterName) -> float:
    """Extra seconds a request of `adapter` costs a replica that has another adapter merged.

    Only the merged adapter's requests run on merged weights, so any other request makes the
    replica unmerge to serve it, and the merged requests then run at unmerged cost. Counting their
    whole remaining work at that cost is pessimistic on purpose: on CPU unmerged steps cost 2-3x
    merged ones, and a dispatch that sends cold requests to a merged replica turns its fast
    merged stream into a slow mixed one (the case where proactive dispatch lost to round-robin).
    """
    merged = view.merged_adapter
    if merged is None or adapter == merged:
        return 0.0
    return sum(request_work(p, r) - request_work(p, r, merged=True) for r in view.requests if r.adapter == merged)


def batch_slot_wait(p: CostParams, view: ReplicaView, adapter: AdapterName) -> float:
    """Seconds a request of `adapter` waits for a batch slot on a replica whose max_loras slots all
    hold other adapters with requests: until the first of those adapters drains (vLLM admits a new
    adapter into a step only once no running request holds one of the slots), i.e. its longest
    remaining request, at one token per step of the replica's current batch. A lower bound (their
    queued requests start later), in wall time rather than work, and zero whenever a slot is free.

    Why dispatch needs it: with 8 adapters and max_loras 4, pending-work balancing spreads every
    adapter over every replica, and a cold adapter's request then sits in vLLM's waiting queue,
    skipped step after step, while the busy replica it was sent to keeps serving four others.
    """
    if not view.waits_for_batch_slot(adapter):
        return 0.0
    left: dict[str, float] = {}
    for r in view.requests:
        if r.adapter is not None:
            left[r.adapter] = max(left.get(r.adapter, 0.0), r.remaining_output_tokens)
    return min(left.values()) * step_seconds(p, view.num_requests)


def step_left(p: CostParams, started_at: float | None, now: float, running: int, prefill_tokens: int) -> float:
    """Seconds until a replica's step under way ends: one started at `started_at` that decodes
    `running` sequences and prefills `prefill_tokens` (those of the requests queued there, which the
    engine admits into it where they fit). 0 once overdue, and when nothing runs or is known."""
    if started_at is None or running + prefill_tokens <= 0:
        return 0.0
    seconds = step_seconds(p, running) + prefill_tokens * p.per_prefill_token_s
    return max(0.0, started_at + seconds - now)


def load_time(p: CostParams, view: ReplicaView, adapter: AdapterName) -> float:
    """Seconds before `adapter` can run on the replica: zero if resident (or the base model)."""
    return 0.0 if view.holds(adapter) else p.adapter_load_s


class ReplicaCostModel:
    """The fitted `CostParams` of one replica, updated from its measured steps, and its adapter
    load price: an exponentially weighted average of the loads the router timed there."""

    def __init__(self, prior: CostParams | None = None, window: int = 256) -> None:
        self.prior = prior or CostParams()
        self.params = self.prior
        self._unmerged: deque[IterationSample] = deque(maxlen=window)
        self._merged: deque[IterationSample] = deque(maxlen=window)
        self._load_s: float | None = None  # None: no load measured yet, the prior prices it

    @property
    def measured(self) -> bool:
        """Whether the step coefficients are fitted from this replica's steps (not the priors).

        Merged steps alone count: a replica that has only run merged (a batch plan that starts
        every replica merged) is priced from them, its unmerged steps through the prior ratio.
        """
        return len(self._unmerged) >= MIN_SAMPLES or len(self._merged) >= MIN_SAMPLES

    @property
    def merged_measured(self) -> bool:
        """Whether `merged_ratio` is fitted from this replica's steps (not the prior): merged steps
        priced against the fit of its unmerged ones. Merged steps alone fix the scale, not the ratio."""
        return len(self._merged) >= MIN_MERGED_SAMPLES and len(self._unmerged) >= MIN_SAMPLES

    def params_with_ratio(self, merged_ratio: float) -> CostParams:
        """The fitted coefficients with `merged_ratio` as the prior merged/unmerged ratio, where
        the ratio is not measured (else the fitted params). A replica priced from its merged
        steps alone keeps their measured cost: its unmerged coefficients move with the ratio."""
        p = self.params
        if self.merged_measured:
            return p
        if self._merged_only:
            scale = max(p.merged_ratio, RATIO_FLOOR) / max(merged_ratio, RATIO_FLOOR)
            p = dataclasses.replace(
                p,
                per_iteration_s=p.per_iteration_s * scale,
                per_decode_token_s=p.per_decode_token_s * scale,
                per_prefill_token_s=p.per_prefill_token_s * scale,
            )
        return dataclasses.replace(p, merged_ratio=merged_ratio)

    @property
    def _merged_only(self) -> bool:
        """Whether the coefficients are fitted from merged steps alone, through the prior ratio."""
        return len(self._unmerged) < MIN_SAMPLES and len(self._merged) >= MIN_SAMPLES

    def observe_load(self, seconds: float) -> None:
        """A measured adapter load on this replica: from asking for it to the replica holding it."""
        if seconds < 0:
            return
        w = LOAD_EWMA_WEIGHT
        self._load_s = seconds if self._load_s is None else (1 - w) * self._load_s + w * seconds
        self.params = dataclasses.replace(self.params, adapter_load_s=self._load_s)

    def observe(self, *samples: IterationSample) -> None:
        """Add measured steps and refit once."""
        kept = [s for s in samples if s.seconds > 0 and s.num_seqs > 0]
        for s in kept:
            (self._merged if s.merged else self._unmerged).append(s)
        if kept:
            self.params = self._fit()

    def _fit(self) -> CostParams:
        p = self.prior
        if len(self._unmerged) >= MIN_SAMPLES:
            p = _fit_linear(p, list(self._unmerged))
        elif self._merged_only:
            # Only merged steps so far: they fix the scale, not the ratio, so the coefficients
            # are the merged fit over the prior ratio and merged steps are predicted as measured.
            return self._with_load(_fit_linear(p, list(self._merged), scale=1 / max(p.merged_ratio, RATIO_FLOOR)))
        if len(self._merged) >= MIN_MERGED_SAMPLES:
            p = dataclasses.replace(p, merged_ratio=_fit_merged_ratio(p, list(self._merged)))
        return self._with_load(p)

    def _with_load(self, p: CostParams) -> CostParams:
        return p if self._load_s is None else dataclasses.replace(p, adapter_load_s=self._load_s)


def _features(s: IterationSample) -> tuple[float, float, float]:
    """A step's features in `StepLine.coefficients` order: (1, prompt tokens, decode sequences)."""
    return 1.0, float(s.prefill_tokens), float(s.decode_tokens)


def _fit_linear(prior: CostParams, samples: list[IterationSample], scale: float = 1.0) -> CostParams:
    """Least squares of the steps' seconds (each multiplied by `scale` first) with coefficients
    >= 0 and a weak ridge towards the prior (0.1% of the data's weight), by `dlora.cost.fit`.

    Why the ridge: steps often all have the same batch size, which makes the plain normal
    equations singular; the prior then decides how the time splits between the coefficients,
    while directions the data does determine are fitted almost as plain least squares.
    """
    rows = [_features(s) for s in samples]
    xx = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    xt = [sum(r[i] * s.seconds * scale for r, s in zip(rows, samples)) for i in range(3)]
    pull = [max(RIDGE * xx[i][i], 1e-12) for i in range(3)]
    theta = fit_nonnegative(xx, xt, prior=prior.line.coefficients(), pull=pull)
    if theta is None:
        return prior
    fixed, per_prefill, per_decode = theta
    return dataclasses.replace(
        prior, per_iteration_s=fixed, per_decode_token_s=per_decode, per_prefill_token_s=per_prefill
    )


def _fit_merged_ratio(p: CostParams, merged: list[IterationSample]) -> float:
    """Median of measured merged step time over the unmerged model's prediction for that step."""
    ratios = []
    for s in merged:
        predicted = p.line.seconds(s.prefill_tokens, s.decode_tokens)
        if predicted > 0:
            ratios.append(s.seconds / predicted)
    return float(np.clip(np.median(ratios), RATIO_FLOOR, 1.5)) if ratios else p.merged_ratio

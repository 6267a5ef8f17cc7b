"""The `dlora` policy: credit-based dynamic batching with adaptive thresholds (Alg. 1–3).

Per `decide(requests, now)`:
1. settle the credit transfer owed for the previous step with its measured duration (now - the
   previous `now`), and relax the other credits toward the initial value;
2. give new adapters the initial credit; update starving/normal states (Alg. 3 lines 6–10);
3. serve starving adapters first if they have requests (lines 11–15; the adapter Alg. 1 would
   run merged is kept out of the fill), else run Alg. 1 over the eligible adapters (lines 17–21);
   with `mixed_merged` merged steps run every request and nobody ever starves;
4. remember the transfer this decision owes and the Alg. 2 sample it starts.
`observe(stats)` learns iteration times and the switch cost, records the Alg. 2 sample (which
tunes alpha/beta at break points), and adopts the mode the engine really ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlora.scheduling.config import BatchingConfig
from dlora.scheduling.cost_model import IterationCostModel
from dlora.scheduling.credits import CreditLedger, Transfer, transfer_for
from dlora.scheduling.dynamic_batching import (
    Queues,
    Step,
    build_queues,
    dynamic_batching,
    request_ids,
    starvation_batch,
)
from dlora.scheduling.policies import BatchingPolicy
from dlora.scheduling.thresholds import AdaptiveThresholds, PeriodSample
from dlora.scheduling.types import Decision, IterationStats, Mode, PolicySnapshot, RequestView, Switch

SWITCH_COST_EMA = 0.5  # weight of a new switch-time measurement in the t_M estimate


class DLoRAPolicy(BatchingPolicy):
    name = "dlora"

    def __init__(self, config: BatchingConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.mode = Mode.UNMERGED
        self.merged: str | None = None
        self.cost = IterationCostModel(c.merged_cost_prior)
        self.thresholds = AdaptiveThresholds(c, self.cost)
        self.ledger = CreditLedger(c.initial_credit, c.t_starve, c.t_normal, c.credit_relax_per_s)
        self.switch_cost = c.switch_cost_s  # t_M, seconds
        self._switch_measured = False
        self.num_switches = 0
        self._last_now: float | None = None
        self._last_ran = False  # the previous decision allowed a batch
        self.last_step_seconds = 0.0  # duration of the last step that ran (cost of line 17)
        self._owed: Transfer | None = None
        self._sample: tuple[Mode, int, str | None] | None = None  # (mode, alternative, candidate)

    # ---- decide -----------------------------------------------------------------------------

    def decide(self, requests: Sequence[RequestView], now: float, max_batch: int | None = None) -> Decision:
        present = {r.adapter for r in requests}
        self._advance_clock(now, present)
        self.ledger.prune(keep=present)  # bounded by the adapters with requests or credit to settle
        self.ledger.ensure(present)
        starving = self.ledger.update_states()
        if not requests:
            self._last_ran, self._sample = False, None
            return Decision(self.mode, self.merged, ())
        q = build_queues(requests, self.batch_size(max_batch))
        alg1 = dynamic_batching(
            q,
            self.mode,
            self.merged,
            self.thresholds.alpha,
            self.thresholds.beta,
            lambda adapter: self._eligible(q, adapter),
            self.config.mixed_merged,
        )
        hot = alg1.merged_adapter if alg1.mode is Mode.MERGED else None
        return self._commit(q, starvation_batch(q, starving, self.mode, self.merged, hot) or alg1)

    def _advance_clock(self, now: float, present: set) -> None:
        if self._last_now is not None:
            dt = max(0.0, now - self._last_now)
            if self._last_ran:
                self.last_step_seconds = dt
            held_back = self.ledger.settle(self._owed, dt, present) if self._owed else []
            self.ledger.relax(dt, held_back)
        self._last_now, self._owed = now, None

    def _eligible(self, q: Queues, adapter: str) -> bool:
        """Alg. 3 line 17: credit covers what merging `adapter` would pay this step."""
        owed = transfer_for(q.merged_run(adapter, self.config.mixed_merged), q.fcfs)
        cost = self.last_step_seconds * len(owed.receivers) if owed else 0.0
        return self.ledger.credit(adapter) - cost >= self.config.min_credit_to_merge

    def _commit(self, q: Queues, step: Step) -> Decision:
        switch = Switch.NONE
        if step.mode is not self.mode:
            switch = Switch.MERGE if step.mode is Mode.MERGED else Switch.UNMERGE
            self.num_switches += 1
        self.mode, self.merged = step.mode, step.merged_adapter
        self._owed = transfer_for(step.priority, q.fcfs) if step.priority is not None else None
        self._last_ran = True
        self._sample = None if step.starvation else (step.mode, self._alternative(q, step), step.candidate)
        return Decision(step.mode, step.merged_adapter, request_ids(step.batch), switch)

    def _alternative(self, q: Queues, step: Step) -> int:
        """Size of the batch the other mode would have run this step (Alg. 2's B'_i or B_i).

        Mixed, merging would run B_fcfs, not R_merge alone: Alg. 2 then compares the same batch in
        both modes, and the merged cost fit learns from mixed steps, whose cost grows with the
        share of other adapters' requests (their LoRA term plus the compensation)."""
        if step.mode is Mode.MERGED:
            return len(q.fcfs)
        return len(q.merged_run(step.candidate, self.config.mixed_merged)) if step.candidate else 0

    # ---- observe ----------------------------------------------------------------------------

    def observe(self, stats: IterationStats) -> None:
        if stats.switch_time > 0:
            self._learn_switch_cost(stats.switch_time)
        self.cost.observe(stats.mode, stats.num_requests, stats.compute_time)
        sample, self._sample = self._sample, None
        if (stats.mode, stats.merged_adapter) != (self.mode, self.merged):
            # The engine ran something else (e.g. a merge failed and it stayed unmerged): adopt it.
            self.mode, self.merged = stats.mode, stats.merged_adapter
            return
        if sample is not None and sample[0] is stats.mode:
            _, alternative, candidate = sample
            self.thresholds.record(
                PeriodSample(stats.mode, stats.num_requests, stats.compute_time, alternative),
                candidate,
                self.switch_cost,
            )

    def _learn_switch_cost(self, seconds: float) -> None:
        if self._switch_measured:
            self.switch_cost += SWITCH_COST_EMA * (seconds - self.switch_cost)
        else:
            self.switch_cost, self._switch_measured = seconds, True

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(
            self.name,
            self.mode,
            self.merged,
            self.num_switches,
            alpha=self.thresholds.alpha,
            beta=self.thresholds.beta,
            credits=dict(self.ledger.credits),
            starving=frozenset(self.ledger.starving),
            switch_cost=self.switch_cost,
        )

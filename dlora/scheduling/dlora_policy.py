"""The `dlora` policy: credit-based dynamic batching with adaptive thresholds (Alg. 1–3).

Per `decide(requests, now)`:
1. settle the credit transfer owed for the previous step with its measured duration (now - the
   previous `now`), and relax the other credits toward the initial value;
2. give new adapters the initial credit; update starving/normal states (Alg. 3 lines 6–10);
3. serve starving adapters first if they have requests (lines 11–15; the adapter Alg. 1 would
   run merged is kept out of the fill), else run Alg. 1 over the eligible adapters (lines 17–21);
   with `mixed_merged` merged steps run every request and nobody ever starves; beside Alg. 1,
   the merge planner (`merge_planner.py`, `merge_planner: true`) merges an adapter, or keeps it
   merged, when serving its queued work merged finishes the known work sooner (not with mixing);
4. remember the transfer this decision owes and the Alg. 2 sample it starts.
`observe(stats)` learns iteration times (per batch size for Alg. 2, per token mix for the
planner) and the switch cost, records the Alg. 2 sample (which
tunes alpha/beta at break points), and adopts the mode the engine really ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dlora.cost.line import StepLine
from dlora.scheduling.config import BatchingConfig
from dlora.scheduling.credits import CreditLedger, Transfer, transfer_for
from dlora.scheduling.dynamic_batching import (
    Queues,
    Step,
    build_queues,
    dynamic_batching,
    fcfs_key,
    request_ids,
    starvation_batch,
)
from dlora.scheduling.iteration_time import IterationTimeModel
from dlora.scheduling.merge_planner import (
    DEFAULT_OUTPUT_TOKENS,
    FinishedLengths,
    LengthTail,
    SlicePlan,
    slice_gain,
    stay_pays,
    work_by_adapter,
)
from dlora.scheduling.policies import BatchingPolicy
from dlora.scheduling.step_model import StepTimeModel
from dlora.scheduling.thresholds import AdaptiveThresholds, PeriodSample
from dlora.scheduling.types import AdapterKey, Decision, IterationStats, Mode, PolicySnapshot, RequestView, Switch
from dlora.slo.priority import LengthStats
from dlora.slo.priority import sort_key as seallm_key

SWITCH_COST_EMA = 0.5  # weight of a new switch-time measurement in the t_M estimate
# The merge planner's merged/unmerged step-cost ratio before merged steps are measured: optimistic,
# so that where merging may pay it is tried (a cached merge costs ~1 ms) and then priced as measured;
# a pessimistic prior would never merge, and so never learn that it should.
PLANNER_MERGED_PRIOR = 0.5
SLICE_MIN_STEPS = 4  # steps a slice runs before a starving adapter may end it...
SLICE_MIN_SWITCHES = 10  # ...and this many times the switch cost
SHAPE_PROBE_MIN = 8  # decoding requests a shape probe needs (it runs half of them)
MIN_LENGTH_SAMPLES = 8  # finished requests an adapter needs before its own lengths set its SeaLLM profile
SHAPE_PROBE_EVERY = 256  # steps between shape probes while the shape stays unknown


class DLoRAPolicy(BatchingPolicy):
    name = "dlora"

    def __init__(self, config: BatchingConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        self.mode = Mode.UNMERGED
        self.merged: str | None = None
        self.cost = IterationTimeModel(c.merged_cost_prior)
        # Token-aware, for the merge planner; merged steps priced optimistically until measured.
        self.steps = StepTimeModel(min(c.merged_cost_prior, PLANNER_MERGED_PRIOR))
        self.lengths = FinishedLengths()
        self.planned_merges = 0  # merges the planner made that Alg. 1's threshold did not
        self.last_slice: SlicePlan | None = None  # the planner's verdict on the slice it started last
        self._slice: str | None = None  # the adapter of the planner's slice under way
        self._slice_steps = 0  # steps it has run
        self._slice_started = 0.0  # when it began (the policy's clock)
        self._since_probe = SHAPE_PROBE_EVERY  # steps since the last shape probe
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
        self.lengths.update(requests)
        self.ledger.prune(keep=present)  # bounded by the adapters with requests or credit to settle
        self.ledger.ensure(present)
        starving = self.ledger.update_states()
        if not requests:
            self._last_ran, self._sample = False, None
            return Decision(self.mode, self.merged, ())
        q = build_queues(requests, self.batch_size(max_batch), self._service_key(requests))
        alg1 = dynamic_batching(
            q,
            self.mode,
            self.merged,
            self.thresholds.alpha,
            self.thresholds.beta,
            lambda adapter: self._eligible(q, adapter),
            self.config.mixed_merged,
        )
        chosen = self._planned(q, requests, alg1, starving)
        if chosen.planned:
            return self._commit(q, chosen)
        hot = chosen.merged_adapter if chosen.mode is Mode.MERGED else None
        planner_on = self._planner_lines() is not None
        return self._commit(q, starvation_batch(q, starving, self.mode, self.merged, hot, planner_on) or chosen)

    def _planner_lines(self) -> tuple[StepLine, StepLine] | None:
        """The step lines the merge planner prices with, or None while it is off or has no data."""
        c = self.config
        if not c.merge_planner or c.mixed_merged:
            return None
        unmerged, merged = self.steps.line(Mode.UNMERGED), self.steps.line(Mode.MERGED)
        return None if unmerged is None or merged is None else (unmerged, merged)

    def _service_key(self, requests: Sequence[RequestView]) -> Callable[[RequestView], tuple] | None:
        """The service order's sort key: None for FCFS; for SeaLLM's, each request's O_r from its
        adapter's recent output lengths here (the pooled ones while an adapter has fewer than
        `MIN_LENGTH_SAMPLES`; a request's cap, else a default, before any request finished)."""
        if self.config.order != "seallm":
            return None
        pooled = self.lengths.pooled()
        if len(pooled) >= MIN_LENGTH_SAMPLES:
            default = LengthStats.of(pooled)
        else:
            caps = [r.max_tokens for r in requests if r.max_tokens is not None]
            default = LengthStats(float(min(caps)) if caps else float(DEFAULT_OUTPUT_TOKENS))
        stats: dict[AdapterKey, LengthStats] = {}
        for adapter in {r.adapter for r in requests}:
            own = self.lengths.of(adapter)
            stats[adapter] = LengthStats.of(own) if len(own) >= MIN_LENGTH_SAMPLES else default

        def key(r: RequestView) -> tuple:
            return (r.priority, *seallm_key(r.arrival_time, r.num_output_tokens, stats[r.adapter], r.req_id))

        return key

    def _planned(self, q: Queues, requests: Sequence[RequestView], alg1: Step, starving: frozenset) -> Step:
        """A merge planner slice (merge_planner.py) where one is under way or pays, else Alg. 1's step.

        A slice merges one adapter and runs its requests (those arriving meanwhile too) until it
        has none, until finishing them merged no longer pays, or until another adapter starves
        (once the slice has run long enough, `_slice_may_end`). The next slice goes to the
        first adapter whose slice pays, starving adapters first, then by credit (the longest held
        back), then by oldest request; it starts straight from the previous one's weights. Slice
        steps owe credit like any step that holds requests back, so the adapters they skip rise in
        the order; Alg. 1's threshold merges and starvation steps apply when no slice pays."""
        lines = self._planner_lines()
        if lines is None:
            self._slice = None
            return self._first_measure(q, alg1)
        unmerged, merged = lines
        if self._slice is not None:
            step = self._continue_slice(q, requests, unmerged, merged, starving)
            if step is not None:
                self._slice_steps += 1
                return step
            self._slice = None
        if alg1.mode is Mode.MERGED and self.mode is Mode.UNMERGED:
            return alg1  # Alg. 1's own merge (its share is above alpha)
        probe = self._shape_probe(q, alg1)
        if probe is not None:
            return probe
        works = work_by_adapter(requests, LengthTail(self.lengths.pooled()))
        for adapter in self._slice_order(q, starving):
            plan = slice_gain(works, adapter, unmerged, merged, self.switch_cost, q.max_batch)
            if plan.pays(self.config.planner_margin):
                self.last_slice = plan
                members = q.group(adapter)
                self._slice, self._slice_steps = adapter, 1
                self._slice_started = self._last_now or 0.0
                self.planned_merges += 1
                return Step(Mode.MERGED, adapter, members[: q.max_batch], members, adapter, planned=True)
        return alg1

    def _slice_may_end(self) -> bool:
        """A slice has run long enough to give way to a starving adapter: `SLICE_MIN_STEPS` steps
        and `SLICE_MIN_SWITCHES` times the switch cost, so switching spends at most ~1/that of the
        time where a switch is dear (a GPU's tens of ms against steps of ten)."""
        elapsed = (self._last_now or 0.0) - self._slice_started
        return self._slice_steps >= SLICE_MIN_STEPS and elapsed >= SLICE_MIN_SWITCHES * self.switch_cost

    def _first_measure(self, q: Queues, alg1: Step) -> Step:
        """Before any unmerged step was measured: the FCFS head alone, unmerged, when Alg. 1 would
        run a batch unmerged. Why: a first batch of long prompts run unmerged can cost more than
        the rest of the burst, and the planner can price merging it only once it has measured
        a step; one request's step is the cheapest measurement (the others wait one step)."""
        c = self.config
        if not c.merge_planner or c.mixed_merged or alg1.mode is not Mode.UNMERGED or self.mode is not Mode.UNMERGED:
            return alg1
        if len(q.fcfs) < 2 or self.steps.steps_seen(Mode.UNMERGED) > 0:
            return alg1
        return Step(Mode.UNMERGED, None, q.fcfs[:1], None, None, planned=True)

    def _shape_probe(self, q: Queues, alg1: Step) -> Step | None:
        """One unmerged step of half the decoding requests, when no decode step has yet split a
        step's fixed cost from its per-sequence cost (a burst whose requests all decode together
        runs one batch size only), at most once per `SHAPE_PROBE_EVERY` steps: a merged slice runs
        fewer sequences per step, so whether it pays turns on that split. The other half waits
        one step (owing no credit: it is the planner's measurement, not a priority)."""
        self._since_probe += 1
        if self.mode is not Mode.UNMERGED or alg1.mode is not Mode.UNMERGED or self.steps.shape_known():
            return None
        if self._since_probe < SHAPE_PROBE_EVERY:
            return None
        decoding = [r for r in q.fcfs if r.running and r.num_computed_tokens >= r.num_prompt_tokens]
        adapters = {r.adapter for r in decoding}
        if len(decoding) < SHAPE_PROBE_MIN or len(decoding) < len(q.fcfs) or adapters <= {None}:
            return None
        self._since_probe = 0
        return Step(Mode.UNMERGED, None, tuple(decoding[: len(decoding) // 2]), None, None, planned=True)

    def _slice_order(self, q: Queues, starving: frozenset) -> list[str]:
        def rank(adapter: str) -> tuple:
            oldest = min(fcfs_key(r) for r in q.group(adapter))
            return (adapter not in starving, -self.ledger.credit(adapter), oldest)

        return sorted((a for a in q.groups if a is not None), key=rank)

    def _continue_slice(
        self, q: Queues, requests: Sequence[RequestView], unmerged: StepLine, merged: StepLine, starving: frozenset
    ) -> Step | None:
        """The slice's next step, or None when it is over: its adapter has no request left,
        merging them no longer pays, the engine is not merged on it (a merge failed), or another
        adapter is starving and the slice has run long enough (`_slice_may_end`: Alg. 3's bound
        holds, up to that, without switching at every step)."""
        adapter = self._slice
        if self.mode is not Mode.MERGED or adapter is None or self.merged != adapter:
            return None
        members = q.group(adapter)
        if not members:
            return None
        if self._slice_may_end() and any(a != adapter and a in q.groups for a in starving):
            return None
        works = work_by_adapter(requests, LengthTail(self.lengths.pooled()))
        if not stay_pays(works, adapter, unmerged, merged, self.switch_cost, q.max_batch):
            return None
        return Step(Mode.MERGED, adapter, members[: q.max_batch], members, adapter, planned=True)

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
        if step.mode is not self.mode or step.merged_adapter != self.merged:
            switch = Switch.MERGE if step.mode is Mode.MERGED else Switch.UNMERGE
            self.num_switches += 1
        self.mode, self.merged = step.mode, step.merged_adapter
        self._owed = transfer_for(step.priority, q.fcfs) if step.priority is not None else None
        self._last_ran = True
        self._sample = (
            None if step.starvation or step.planned else (step.mode, self._alternative(q, step), step.candidate)
        )
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
        self.steps.observe(stats.mode, stats.prefill_tokens, stats.num_requests, stats.compute_time)
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
            planner=self._planner_state(),
        )

    def _planner_state(self) -> dict | None:
        lines = self._planner_lines()
        if lines is None:
            return None
        last = self.last_slice
        return {
            "unmerged": [round(v, 7) for v in (lines[0].fixed_s, lines[0].per_prefill_token_s, lines[0].per_seq_s)],
            "merged": [round(v, 7) for v in (lines[1].fixed_s, lines[1].per_prefill_token_s, lines[1].per_seq_s)],
            "last_slice": None if last is None else [last.adapter, round(last.gain_s, 4), round(last.merged_s, 4)],
        }

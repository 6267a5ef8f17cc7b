"""Algorithms 1 and 3 of dLoRA (§4.2, Appendix A) as pure functions over one step's requests.

NOTE (the algorithm block, read with papers/dlora-osdi24.txt Alg. 1 and Alg. 3)
--------------------------------------------------------------------------------
Per step the policy sees every unfinished request R (running or waiting) and returns the batch
B_next it allows, the mode, and a switch. Terms:

- FCFS order: by (arrival_time, req_id). B_fcfs = the first max_bs requests in that order: the
  batch plain FCFS would run. Requests for the base model (adapter None) are part of it.
- Service order (`scheduling.order`): FCFS, or SeaLLM's doubling-budget priority
  (dlora/slo/priority.py). Where the paper runs B_fcfs, the policy runs the first max_bs requests
  in service order, each adapter's merged batch takes its requests in service order, and a
  starvation step fills in service order; credits still measure against B_fcfs, so an adapter the
  order pushes back is held back and paid like one a merge pushes back (Alg. 3 bounds both).
- R_l: the requests of adapter l, in FCFS order. R_merge = R_l for the merge candidate l, the
  adapter with the most requests among the *eligible* adapters (ties: older oldest request, then
  name). The base model is never a candidate: it has nothing to merge.
- ratio(l) = min(|R_l|, max_bs) / |B_fcfs|: the largest same-adapter batch that could run merged,
  against the FCFS batch. It lies in (0, 1]; it is 1 when l alone fills the FCFS batch. (§4.2's
  prose says "the FCFS batch size ratio to R_merge" for beta; we follow the pseudo-code, the
  same |R_merge| / |B_fcfs| for both thresholds.)

Alg. 1 (dynamic batching), given the current mode:
- UNMERGED: if ratio(R_merge) > alpha -> switch MERGE, run R_merge[:max_bs] merged; else run
  B_fcfs unmerged (no switch).
- MERGED on adapter m: if m has no request, or m is not eligible, or ratio(m) < beta -> switch
  UNMERGE and run B_fcfs; else run R_m[:max_bs] merged. It never goes from one merged adapter
  straight to another: that is UNMERGE now and, if the ratio says so, MERGE at a later step.
- While merged, m's requests run with no LoRA (their delta is in the weights). Without mixing
  (the paper), only they run: a base or other-adapter request would compute wrong results on the
  merged weights.
- Mixed merged steps (`BatchingConfig.mixed_merged`, not in the paper): the LoRA layers add
  dY_t·x - dm·x to every token t that is not m's (dY_t = its own adapter's delta, none for the
  base model), so on W + dm it computes W·x + dY_t·x, the unmerged result up to rounding. A MERGED
  step then runs B_fcfs, like an UNMERGED one; only the weights (and so the step's cost) differ.
  The switch rules above stay. Nobody is held back, so no credit is ever transferred and nobody
  starves: Alg. 3 is inert. For Alg. 2, the batch merging would run is B_fcfs as well.

Alg. 3 (credits, see credits.py), wrapped around Alg. 1:
- Lines 6–10: states with hysteresis: an adapter whose credit exceeds t_starve is *starving*
  until its credit falls below t_normal. Credit is in seconds and grows by one second per second
  an adapter's requests sit in B_fcfs without running, so the paper's credit test is a time
  bound: an adapter starting at initial_credit is held back at most t_starve - initial_credit
  (plus one step) before it is served first.
- Lines 11–15: if starving adapters have requests, B_starve = their requests in FCFS order
  [:max_bs] is served first, and they pay transfer_credit(B_starve, B_fcfs). Our choice (the
  paper returns B_starve alone): the rest of the batch is filled in FCFS order, so a starvation
  step never runs a nearly empty batch — except with the requests of the adapter Alg. 1 would run
  merged this step (`hot`): they wait instead, as in the paper's B_starve-only step. Filling with
  them runs the hot adapter unmerged for the whole starvation period (on CPU an unmerged step costs
  2-3x a merged one), while waiting costs a few steps and a re-merge (about 1 ms from the cached
  merged kernels). Measured in the step simulator the two are about even (within 1-5% by skew);
  the benchmark did not separate them either. The fee is still computed against B_starve, so a starving adapter pays for
  its priority and its credit falls back under t_normal. A starvation step runs unmerged
  (switching UNMERGE if needed) unless the merged adapter is the only starving one.
- Line 17: l is eligible (may be merged, or stay merged) only if
  credit(l) - cost(l) >= min_credit_to_merge, where cost(l) is what merging l would pay this step
  (receivers x the last step's duration).
- Lines 19–21: when Alg. 1 returns a batch other than B_fcfs, transfer_credit(batch, B_fcfs).
  Transfers are settled at the next `decide`, with the measured duration of the step.

Alg. 2 (thresholds.py) tunes alpha and beta from measured iteration times, switch cost included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dlora.scheduling.types import AdapterKey, Mode, RequestView


def fcfs_key(r: RequestView) -> tuple[int, float, str]:
    """First come, first served within a priority: batch work (a larger priority) waits for every
    online request, however long it has queued."""
    return (r.priority, r.arrival_time, r.req_id)


@dataclass(frozen=True, slots=True)
class Queues:
    """One step's requests, grouped and ordered once.

    Two orders: arrival (FCFS), which defines B_fcfs and so what credits measure (Alg. 3), and
    service, the order requests are served in where Alg. 1 runs "the FCFS batch" and within an
    adapter's merged batch. They are the same unless the policy serves in another order
    (`scheduling.order: seallm`, SeaLLM's doubling-budget priority)."""

    ordered: tuple[RequestView, ...]  # all requests, FCFS order
    fcfs: tuple[RequestView, ...]  # B_fcfs = ordered[:max_batch]
    groups: dict[AdapterKey, tuple[RequestView, ...]]  # adapter (None = base) -> requests, service order
    max_batch: int
    served: tuple[RequestView, ...] = ()  # all requests in service order (empty: FCFS)

    @property
    def batch(self) -> tuple[RequestView, ...]:
        """The unmerged batch: the first max_batch requests in service order (B_fcfs under FCFS)."""
        return self.served[: self.max_batch] if self.served else self.fcfs

    def group(self, adapter: AdapterKey) -> tuple[RequestView, ...]:
        return self.groups.get(adapter, ())

    def merged_batch(self, adapter: str) -> tuple[RequestView, ...]:
        return self.group(adapter)[: self.max_batch]

    def ratio(self, adapter: str) -> float:
        return len(self.merged_batch(adapter)) / len(self.fcfs) if self.fcfs else 0.0

    def merged_run(self, adapter: str, mixed: bool) -> tuple[RequestView, ...]:
        """The batch a step with `adapter` merged runs: the unmerged batch when others are compensated."""
        return self.batch if mixed else self.merged_batch(adapter)


def build_queues(
    requests: Iterable[RequestView], max_batch: int, service_key: Callable[[RequestView], Any] | None = None
) -> Queues:
    """The step's queues; `service_key` orders service (None: FCFS)."""
    ordered = tuple(sorted(requests, key=fcfs_key))
    served = tuple(sorted(ordered, key=service_key)) if service_key is not None else ()
    groups: dict[AdapterKey, list[RequestView]] = {}
    for r in served or ordered:
        groups.setdefault(r.adapter, []).append(r)
    return Queues(ordered, ordered[:max_batch], {a: tuple(g) for a, g in groups.items()}, max_batch, served)


def merge_candidate(q: Queues, eligible: Callable[[str], bool]) -> str | None:
    """R_merge of Alg. 1 line 7: the eligible adapter with the most requests."""
    best: tuple[int, float, str] | None = None
    for adapter, reqs in q.groups.items():
        if adapter is None or not eligible(adapter):
            continue
        key = (-len(reqs), reqs[0].arrival_time, adapter)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


@dataclass(frozen=True, slots=True)
class Step:
    """What one of the algorithms chose for this step."""

    mode: Mode
    merged_adapter: str | None
    batch: tuple[RequestView, ...]
    # The batch credits are charged against B_fcfs for (RET or B_starve); None when B_fcfs ran.
    priority: tuple[RequestView, ...] | None
    candidate: str | None  # R_merge's adapter (the merged one when merged), for Alg. 2 periods
    starvation: bool = False
    planned: bool = False  # a merge planner slice (merge_planner.py): owes no credit, tunes no threshold


def _fcfs_step(q: Queues, candidate: str | None) -> Step:
    """The unmerged batch; it owes credit only where it is not B_fcfs (another service order)."""
    batch = q.batch
    return Step(Mode.UNMERGED, None, batch, None if batch is q.fcfs else batch, candidate)


def _merged_step(q: Queues, adapter: str, mixed: bool) -> Step:
    batch = q.merged_run(adapter, mixed)
    return Step(Mode.MERGED, adapter, batch, None if mixed else batch, adapter)


def dynamic_batching(
    q: Queues,
    mode: Mode,
    merged: str | None,
    alpha: float,
    beta: float,
    eligible: Callable[[str], bool],
    mixed: bool = False,
) -> Step:
    """Algorithm 1. `eligible` is Alg. 3 line 17's L_eligible as a predicate; `mixed`: merged
    steps run B_fcfs (see the NOTE)."""
    if mode is Mode.UNMERGED:
        candidate = merge_candidate(q, eligible)
        if candidate is not None and q.ratio(candidate) > alpha:
            return _merged_step(q, candidate, mixed)
        return _fcfs_step(q, candidate)
    assert merged is not None
    if not q.group(merged) or not eligible(merged) or q.ratio(merged) < beta:
        return _fcfs_step(q, merged)
    return _merged_step(q, merged, mixed)


def starvation_batch(
    q: Queues,
    starving: Iterable[AdapterKey],
    mode: Mode,
    merged: str | None,
    hot: str | None = None,
    decode_fill_only: bool = False,
) -> Step | None:
    """Alg. 3 lines 11–15 (B_starve first, the rest filled FCFS except `hot`'s requests, which
    Alg. 1 would run merged); None when nobody starving waits. `decode_fill_only` (the merge
    planner is on): the fill leaves out requests with prompt tokens still to compute, whose
    prefill a merged slice does cheaper than this unmerged step would."""
    starving = set(starving)
    b_starve = tuple(r for r in (q.served or q.ordered) if r.adapter in starving)[: q.max_batch]
    if not b_starve:
        return None
    if mode is Mode.MERGED and all(r.adapter == merged for r in b_starve):
        return Step(Mode.MERGED, merged, b_starve, b_starve, merged, starvation=True)
    chosen = {r.req_id for r in b_starve}
    fill = tuple(
        r
        for r in q.batch
        if r.req_id not in chosen
        and (hot is None or r.adapter != hot)
        and not (decode_fill_only and r.num_computed_tokens < r.num_prompt_tokens)
    )
    batch = (b_starve + fill)[: q.max_batch]
    return Step(Mode.UNMERGED, None, batch, b_starve, None, starvation=True)


def request_ids(batch: Sequence[RequestView]) -> tuple[str, ...]:
    return tuple(r.req_id for r in batch)

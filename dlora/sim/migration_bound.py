"""What moving requests between replicas could gain over dispatch at arrival, on a given trace.

dLoRA's reactive half exists because dispatch decides once, at arrival, on estimated lengths: a
request may then wait on one replica while another frees a slot, or be preempted on a replica
whose KV fills while another has room. The natural limit of moving queued requests is *late
binding*: one queue for the whole cluster, in arrival order, each request starting on whichever
replica frees a slot for it first, with moves free and instant. The ratio

    mean queueing delay(dispatch at arrival) / mean queueing delay(other discipline)

on the same requests is then what that discipline wins over dispatch alone (dLoRA's "vs
proactive-only"). Late binding is not a strict bound: it ignores adapter grouping and KV, and
where those bind, dispatch followed by quick moves beats it; so several disciplines are run and
the best is what migration could reach. This module runs them with an event-driven model of the
replicas (`dlora.sim.replica_model`, one class per discipline in `dlora.sim.disciplines`),
cheaply and without the machine's noise:

- a replica runs continuous-batching steps: at each step start it admits queued requests in
  arrival order while it has a free running slot (`max_running`), skipping one whose adapter would
  be one distinct adapter too many for a step (`max_loras`, as vLLM does) or could not be loaded
  (`adapter_slots` full of adapters with requests there); the step lasts `StepCosts.step`
  (`dlora.sim.step_costs`, the batching simulator's model: unmerged LoRA, the `cpu-einsum` fit by
  default, plus the load time of adapters it loads; dispatch sees the same costs as the router's
  `CostParams`, `ReplicaModel.cost_params`) and gives each
  running request one token; an admitted request's first step prefills its prompt;
- `at_arrival`: each request goes, once, where the real `ProactiveDispatch` by pending time alone
  (dLoRA's dispatch, no start slack) sends it, over views of the modelled replicas with expected
  lengths from the real `OutputLengthEstimator` fed with finished requests (`oracle_lengths` gives
  dispatch the true lengths instead);
- `late_binding`: the cluster-wide queue above;
- `static` (with `homes`): each request to its adapter's one home replica, dLoRA's round-robin
  baseline over a static placement;
- `moves`: dispatch at arrival, and any replica starting a step also takes requests queued
  elsewhere that have waited `move_after_s` (oldest first): queued-request migration that reacts
  within about a step and an RPC. Late binding also wins, where waits are short, by starting a
  request at whichever replica's step boundary comes first, which no real move is quick enough
  for; `moves` leaves that out;
- `soonest_start`: dispatch at arrival as the server ships it (`cluster.dispatch_start_slack_s`):
  among the replicas with a free running slot and KV room, those whose step under way ends within
  the slack of the soonest (the model knows when each step ends; the router estimates it from when
  the replica's tokens last came and its cost model), then the least pending time; no moves;
- `balancer`: the shipped dispatch (`soonest_start`), then the shipped balancer's own planners on
  its own schedule: every `TICK_S` the queued-request planner (`migration.queued.plan_queued`:
  requests queued a tick or more, preempted ones included, to replicas that can start them), then
  dLoRA's triggers (`check_trigger`: KV, count imbalance, queueing delay; a round at most every 2 s)
  and on one, the co-migration ILP (`plan_migration`), run only when its moves are simulated to pay
  (`migration.simulated_gain.checked`, the server's default draws), whose moved running requests
  recompute their context on the receiver;
- `balancer_events`: `balancer`, and the queued-request planner also runs on events, as the
  server's balancer does (`cluster.event_moves_min_wait_s`): whenever a replica's step ends with
  requests finished (slots freed), to that replica, and when a request has waited `move_after_s`
  on the replica it was last sent to, to idle replicas; it moves requests queued `move_after_s` or
  more that the receivers can start now.

With `kv_blocks`, a replica admits a request only while its KV blocks fit, and before a step
whose growing contexts do not fit it preempts its latest-arriving running requests, as vLLM does
(they recompute prompt and output when they start again); under late binding and moves a
preempted request may restart on another replica, the ideal of moving running requests out of a
full replica. Left out: merging, and migration's own cost beyond that recompute (which only makes
the bound looser). Queueing delay is first admission minus arrival, the engines' own measure;
`Outcome` also has each request's end-to-end latency, TTFT and time per output token, and the
preemptions.

SLO-aware serving (`slo`, a `dlora.slo.config.SloConfig`; its default is everything above) runs
the server's policy code in the same model, so the policies can be compared at cluster sizes no
machine here runs:

- `order: seallm`: each replica admits its queued requests in SeaLLM's doubling-budget order
  (`dlora.slo.priority.sort_key`) instead of arrival, and a replica whose KV runs out preempts the
  running request last in that order. Each adapter's profile is the mean and deviation of its
  finished requests' lengths (the router's `OutputLengthEstimator`, cluster-wide, where the
  server keeps one per engine), the pooled lengths while it has fewer than the estimator's
  `min_samples`, and the requests' cap before 8 requests finished anywhere, as the server does.
- `dispatch: slo_feasible | best_fit`: dispatch at arrival by Aladdin's feasibility checks
  (`dlora.cluster.feasible_dispatch.choose`) over the same views, each running request's seconds
  since its first token as its decode time, and each request's SLO as the accounting sets it.
- `kv_quotas`: MuxServe's per-adapter KV quotas (`dlora.slo.kv_shares.KvQuotas`, one per replica,
  fed with each request dispatched there and re-adapted every `quota_period_s`). Once a period has
  set quotas, `plan_admissions` decides each step which queued requests may start: every request
  its adapter's quota covers first, in the replica's order, then borrowers while blocks are free.
  A request within its quota that finds too few free blocks takes them back from borrowers
  (`KvQuotas.admit`'s reclaim: their running requests preempted, last in order first, as
  MuxServe's lending prescribes; the server instead leaves them to vLLM's preemption, where they
  go first), and preemption for KV growth takes borrowers' requests first.

Every finished request is judged by `dlora.slo.accounting.SloAccounting` with the isolated times of
the model's own `CostParams` (`Outcome.slo`). Every replica meters rates as the quotas do, quotas
on or off, so MuxServe's fairness gap (max |R_a - R_b|, R = KV blocks held / request rate) is
sampled at each replica's every period boundary in every configuration (`Outcome.fairness_gaps`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dlora.cluster.migration.trigger import TriggerConfig
from dlora.config import ClusterConfig
from dlora.sim.disciplines import (
    MOVE_AFTER_S,
    AtArrival,
    Balancer,
    BalancerEvents,
    LateBinding,
    Moves,
    SoonestStart,
    Static,
)
from dlora.sim.model_io import Outcome, ReplicaModel, TraceRequest
from dlora.sim.replica_model import ModelledCluster
from dlora.slo.config import SloConfig

DISCIPLINES = tuple(d.name for d in (AtArrival, LateBinding, Moves, SoonestStart, Balancer, BalancerEvents))
STATIC = Static.name  # the round-robin baseline over a static placement: every request at its adapter's home
# `balancer`: as bench/cluster_balancing's servers run it (monitor interval, round interval,
# count trigger; the queue-delay trigger's default)
TICK_S = 0.5
ROUND_TRIGGER = TriggerConfig(interval_s=2.0, count_imbalance=4, queue_delay_s=2.0)
CHECK_DRAWS = ClusterConfig().migration_check_draws  # the server's default


def make_model(
    jobs: Sequence[TraceRequest],
    replicas: int,
    model: ReplicaModel,
    discipline: str,
    oracle_lengths: bool = False,
    move_after_s: float = MOVE_AFTER_S,
    homes: Mapping[str, int] | None = None,
    slo: SloConfig | None = None,
) -> ModelledCluster:
    """The model of `jobs` on `replicas` under `discipline` (a name of `DISCIPLINES` or `STATIC`)."""
    common = (jobs, replicas, model)
    if discipline == STATIC:
        return Static(*common, homes=homes, oracle_lengths=oracle_lengths, slo=slo)
    if discipline == Moves.name:
        return Moves(*common, move_after_s=move_after_s, oracle_lengths=oracle_lengths, slo=slo)
    if discipline == Balancer.name:
        return Balancer(
            *common,
            tick_s=TICK_S,
            trigger=ROUND_TRIGGER,
            check_draws=CHECK_DRAWS,
            oracle_lengths=oracle_lengths,
            slo=slo,
        )
    if discipline == BalancerEvents.name:
        return BalancerEvents(
            *common,
            tick_s=TICK_S,
            trigger=ROUND_TRIGGER,
            check_draws=CHECK_DRAWS,
            move_after_s=move_after_s,
            oracle_lengths=oracle_lengths,
            slo=slo,
        )
    plain = {d.name: d for d in (AtArrival, LateBinding, SoonestStart)}
    if discipline not in plain:
        raise ValueError(f"discipline {discipline!r}: choose from {', '.join((*DISCIPLINES, STATIC))}")
    return plain[discipline](*common, oracle_lengths=oracle_lengths, slo=slo)


_Model = make_model  # the name the simulators' tests build models by


def simulate(
    jobs: Sequence[TraceRequest],
    replicas: int,
    model: ReplicaModel,
    discipline: str,
    oracle_lengths: bool = False,
    move_after_s: float = MOVE_AFTER_S,
    homes: Mapping[str, int] | None = None,
    slo: SloConfig | None = None,
) -> Outcome:
    """`jobs` under `discipline`, with `slo`'s order, dispatch and KV quotas (see the module docstring)."""
    return make_model(jobs, replicas, model, discipline, oracle_lengths, move_after_s, homes, slo).run()


def capacity_rps(model: ReplicaModel, replicas: int, jobs: Sequence[TraceRequest]) -> float:
    """Requests per second `replicas` modelled replicas complete on `jobs`' lengths with every
    running slot busy: a full batch's steps for the mean output, plus each request's prefill."""
    c = model.costs
    mean_out = statistics.fmean(j.output_len for j in jobs)
    mean_prompt = statistics.fmean(j.prompt_len for j in jobs)
    b = model.max_running
    if model.kv_blocks is not None:  # as many as fit in KV at their mean context (prompt + half the output)
        b = max(1, min(b, int(model.kv_blocks * model.block_tokens // (mean_prompt + mean_out / 2))))
    step = c.step(b, 0, b, 0, model.max_loras)
    per_batch = mean_out * step + b * mean_prompt * (c.per_prefill_token_s + c.lora_per_prefill_token_s)
    return replicas * b / per_batch


def queue_delays(
    jobs: Sequence[TraceRequest], replicas: int, model: ReplicaModel, discipline: str, **kw
) -> list[float]:
    """Each job's seconds from arrival to its first admission under `discipline`."""
    return simulate(jobs, replicas, model, discipline, **kw).queue_s


def bound(
    jobs: Sequence[TraceRequest], replicas: int, model: ReplicaModel, homes: Mapping[str, int] | None = None
) -> dict:
    """Mean queueing delay and latency under each discipline on `jobs` (and the static baseline,
    given `homes`), each migrating discipline's gain over dispatch alone, and the best of them."""
    runs = {d: simulate(jobs, replicas, model, d) for d in DISCIPLINES}
    runs["at_arrival_oracle"] = simulate(jobs, replicas, model, "at_arrival", True)
    if homes is not None:
        runs[STATIC] = simulate(jobs, replicas, model, STATIC, homes=homes)
    means = {d: statistics.fmean(o.queue_s) for d, o in runs.items()}

    def ratio(num: str, den: str) -> float | None:
        return means[num] / means[den] if means[den] > 0 else None

    out: dict[str, Any] = {
        "mean_queue_s": means,
        "mean_latency_s": {d: statistics.fmean(o.latency_s) for d, o in runs.items()},
        "preemptions": {d: o.preemptions for d, o in runs.items()},
        "balancer_moved": runs["balancer"].moved,
        "balancer_moved_running": runs["balancer"].moved_running,
        "balancer_events_moved": runs["balancer_events"].moved,
        "gain_of_late_binding": ratio("at_arrival", "late_binding"),
        "gain_of_moves": ratio("at_arrival", "moves"),
        "gain_of_soonest_start": ratio("at_arrival", "soonest_start"),
        "gain_of_balancer": ratio("at_arrival", "balancer"),
        "gain_of_balancer_events": ratio("at_arrival", "balancer_events"),
    }
    keys = (
        "gain_of_late_binding",
        "gain_of_moves",
        "gain_of_soonest_start",
        "gain_of_balancer",
        "gain_of_balancer_events",
    )
    gains = [g for k in keys if (g := out[k]) is not None]
    out["best_gain"] = max(gains) if gains else None
    if homes is not None:  # dispatch at arrival against the static baseline
        out["dispatch_vs_static"] = ratio(STATIC, "at_arrival")
    return out

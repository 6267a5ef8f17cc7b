"""Is a co-migration round worth its recompute? Sample the output lengths, then simulate.

The co-migration ILP balances *expected* pending work, and a move of a running request pays at
once: the request gives up its KV and re-prefills its prompt and generated tokens on the receiver.
Whether that pays back depends on how long the requests left behind and those already on the
receiver still run, which only their output-length distributions know. So before a round that
moves running requests runs, its effect is simulated, as SamuLLM checks a plan: `draws` times,
each affected request's remaining output is drawn from its adapter's observed lengths longer than
what it has generated (the router's `OutputLengthEstimator`; its expected remainder while nothing
longer was observed), and every replica the round touches is simulated with its step-cost model
(`dlora.cluster.estimators.held_work.finish_times`: running requests first, then the queue in
arrival order, `max_batch` at a time), with and without the moves. A moved request joins the receiver's queue in
its arrival order and prefills its whole context there. The gain of one draw is the drop in the
summed completion times of the touched replicas' requests (their mean latency, times their
count); the round runs when the median gain is positive.

Pure functions over `ReplicaView`s: the balancer and the cluster model (`dlora.sim.migration_bound`)
call the same code.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dlora.cluster.estimators.held_work import draw_remaining, finish_times
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.migration.ilp import MigrationPlan
from dlora.cluster.policy_views import AdapterName, ReplicaView


@dataclass(frozen=True)
class SimulatedGain:
    """What a round's moves are expected to save: the drop in the touched replicas' summed
    completion times (seconds; negative when the round makes them later), median over draws."""

    median_s: float
    draws: int

    @property
    def worth_it(self) -> bool:
        return self.median_s > 0


def simulated_gain(
    views: Sequence[ReplicaView],
    moves: Sequence[tuple[str, int, int]],
    params: Mapping[int, CostParams],
    lengths_of: Callable[[AdapterName], Sequence[int]],
    draws: int,
    seed: int = 0,
) -> SimulatedGain:
    """The median over `draws` samples of the completion time the moves save (see the module)."""
    dst_of = {rid: dst for rid, _, dst in moves}
    touched = {rid for _, src, dst in moves for rid in (src, dst)}
    on = {v.replica_id: v.requests for v in views if v.replica_id in touched}
    if not dst_of or not on:
        return SimulatedGain(0.0, 0)
    lengths = {r.adapter: sorted(lengths_of(r.adapter)) for reqs in on.values() for r in reqs}
    # Where each request is after the moves (the same for every draw).
    after_moves = {
        rid: [r for src, reqs in on.items() for r in reqs if dst_of.get(r.request_id, src) == rid] for rid in on
    }
    moved_in = {rid: {r.request_id for r in reqs if r.request_id in dst_of} for rid, reqs in after_moves.items()}
    rng = random.Random(seed)
    gains = []
    for _ in range(draws):
        left = {r.request_id: draw_remaining(r, lengths[r.adapter], rng) for reqs in on.values() for r in reqs}
        before = sum(sum(finish_times(reqs, left, params[rid])) for rid, reqs in on.items())
        after = sum(sum(finish_times(reqs, left, params[rid], moved_in[rid])) for rid, reqs in after_moves.items())
        gains.append(before - after)
    return SimulatedGain(statistics.median(gains), draws)


def checked(
    plan: MigrationPlan,
    views: Sequence[ReplicaView],
    params: Mapping[int, CostParams],
    lengths_of: Callable[[AdapterName], Sequence[int]],
    draws: int,
) -> tuple[MigrationPlan, SimulatedGain | None]:
    """`plan` as it is when it moves no running request (or `draws` is 0); else, when the
    simulation finds no gain, the same plan with nothing to do. Also the gain simulated, if any."""
    running = {r.request_id for v in views for r in v.requests if r.running}
    if draws <= 0 or not any(rid in running for rid, _, _ in plan.moves):
        return plan, None
    gain = simulated_gain(views, plan.moves, params, lengths_of, draws)
    if gain.worth_it:
        return plan, gain
    status = f"{plan.status}; not run: simulated gain {gain.median_s:.3f} s"
    return dataclasses.replace(plan, moves=(), loads=(), status=status), gain

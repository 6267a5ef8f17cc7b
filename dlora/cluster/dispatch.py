"""Which replica a new request goes to (dLoRA §5.1, "adapter-aware dispatch").

Why pending time and not request counts: a burst for one adapter piles onto the few replicas
holding it, while sending it elsewhere costs an adapter load. dLoRA sends each request to the
replica with the shortest *estimated pending time*: the replica's queued + running work (cost
model), plus the adapter load time where the adapter is absent (an average of the loads the router
timed on that replica, `ReplicaCostModel.observe_load`), plus the request's own work
there (cheaper where its adapter is merged), plus the slowdown it would cause where another
adapter is merged (that replica must unmerge to serve it). So a holder wins ties and small differences, and
a burst spills over to non-holders, which then load the adapter, once the holders fall behind.
A replica where max_loras other adapters already have requests is charged the wait for one of
them to drain (`batch_slot_wait`), so a cold adapter's requests gather where it already runs
instead of queueing behind four others.
A replica whose KV use is at or above `kv_high` counts as overloaded and is skipped while any
other can take the request, and a non-holder with no free adapter slot, or (with a host cache in
bytes) too few bytes that it could free for the adapter's weights, cannot take it at all.

With `start_slack_s` set (`cluster.dispatch_start_slack_s`) dispatch first asks when the request
would start: on a replica with a free running slot (and KV room for its prompt below `kv_high`),
when its engine step under way ends (the router times each replica's steps) plus the adapter load;
only replicas within `start_slack_s` of the soonest such start are then compared by pending time.
Why: a replica admits new requests only between steps, and a CPU step with a long prefill in it
lasts most of a second, so pending-time dispatch sent requests to a replica in the middle of one
while another replica was about to start its next step (bench/migration_bound measures the gain).
When no replica has a free slot, pending time alone decides.

The round-robin and least-loaded policies are the baselines of `bench/cluster_balancing`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from dlora.cluster.errors import ClusterError
from dlora.cluster.estimators.replica_cost import (
    CostParams,
    batch_slot_wait,
    load_time,
    merge_disruption,
    pending_time,
    prefill_saved,
    request_work,
    step_seconds,
)
from dlora.cluster.policy_views import AdapterTotals, LoadTotals, ReplicaView, RequestLoad

KV_HIGH = 0.90


@dataclass(frozen=True, slots=True)
class DispatchDecision:
    replica_id: int
    load_adapter: bool  # the adapter is absent there: load it before the request may run
    pending_s: float  # estimated pending time on that replica, load and own work included


class NoEligibleReplica(ClusterError):
    """No healthy replica can take the request now: none holds its adapter, and none has a free
    adapter slot (and, with a host cache in bytes, the room for its weights) that requests in
    flight and pinned adapters leave. A 503: a retry after some requests end may find room."""

    http_status = 503


def estimate(view: ReplicaView, req: RequestLoad, params: CostParams) -> float:
    """Pending seconds for `req` if sent to `view`: backlog + adapter load + its own work (less the
    prefill its prompt's cached prefix there saves), plus the slowdown it causes a replica that has
    another adapter merged, plus its wait for a batch slot where max_loras other adapters hold them all."""
    merged = req.adapter is not None and req.adapter == view.merged_adapter
    own = (
        load_time(params, view, req.adapter)
        + request_work(params, req, merged)
        - prefill_saved(params, req, view.replica_id, merged)
    )
    if view.totals is not None:
        return own + _from_totals(params, view, view.totals, req.adapter)
    return (
        own
        + pending_time(params, view)
        + merge_disruption(params, view, req.adapter)
        + batch_slot_wait(params, view, req.adapter)
    )


def _group_work(p: CostParams, g: AdapterTotals) -> float:
    """`request_work` summed over a group (it is linear in prefill and remaining output tokens)."""
    per_token = p.per_decode_token_s + p.per_iteration_s / p.max_batch
    return g.queued_context_tokens * p.per_prefill_token_s + g.remaining_output_tokens * per_token


def _from_totals(p: CostParams, view: ReplicaView, totals: LoadTotals, adapter) -> float:
    """pending_time + merge_disruption + batch_slot_wait of estimators/replica_cost.py, from the replica's sums."""
    merged = view.merged_adapter
    pending = disruption = 0.0
    for name, g in totals.by_adapter.items():
        work = _group_work(p, g)
        if merged is not None and name == merged:
            pending += work * p.merged_ratio
            if adapter != merged:  # serving `adapter` unmerges the replica: its merged requests slow down
                disruption += work - work * p.merged_ratio
        else:
            pending += work
    wait = 0.0
    if view.waits_for_batch_slot(adapter):
        longest = min(g.longest_remaining for a, g in totals.by_adapter.items() if a is not None)
        wait = longest * step_seconds(p, totals.requests)
    return pending + disruption + wait


class DispatchPolicy(ABC):
    name: ClassVar[str]
    # It compares replicas by priced work (`estimate`), where a cached prompt prefix saves prefill;
    # False: a baseline blind to work and to prefix caches
    prices_work: ClassVar[bool] = False

    @abstractmethod
    def choose(
        self, replicas: Sequence[ReplicaView], req: RequestLoad, params: Mapping[int, CostParams]
    ) -> DispatchDecision:
        """The replica for `req` (`params` maps replica_id to its cost model; missing = priors)."""

    def _decide(self, view: ReplicaView, req: RequestLoad, params: Mapping[int, CostParams]) -> DispatchDecision:
        p = params.get(view.replica_id, CostParams())
        return DispatchDecision(view.replica_id, not view.holds(req.adapter), estimate(view, req, p))

    @staticmethod
    def _eligible(replicas: Sequence[ReplicaView], req: RequestLoad) -> list[ReplicaView]:
        eligible = [v for v in replicas if v.can_take(req.adapter, req.adapter_bytes)]
        if not eligible:
            raise NoEligibleReplica(
                f"no replica holds adapter {req.adapter!r} or has room to load it now (every adapter slot or "
                "host cache byte is taken by pinned adapters or adapters with requests in flight); retry later"
            )
        return eligible


def start_wait(view: ReplicaView, req: RequestLoad, params: CostParams) -> float:
    """Seconds before `req` would join a step on `view`, where a running slot is free for it: the
    step under way, then its adapter's load, less the prefill its cached prompt prefix saves there.
    Why the saving: what the slack compares is when the request's first token could come, and a
    replica mid-step that holds a conversation's history may give it sooner than an idle one that
    must prefill all of it (without this, the holder was filtered out whenever it was mid-step)."""
    return view.step_left_s + load_time(params, view, req.adapter) - prefill_saved(params, req, view.replica_id)


def soonest_starts(
    replicas: Sequence[ReplicaView],
    req: RequestLoad,
    params: Mapping[int, CostParams],
    slack_s: float,
    kv_high: float = KV_HIGH,
) -> list[ReplicaView]:
    """The replicas with a free slot for `req`, and KV room for its context below `kv_high`, that
    would start it within `slack_s` of the soonest of them; all of `replicas` when none has both."""
    free = [v for v in replicas if v.has_free_slot(req.adapter) and v.kv_room(kv_high) >= req.context_tokens]
    if not free:
        return list(replicas)
    waits = [start_wait(v, req, params.get(v.replica_id, CostParams())) for v in free]
    soonest = min(waits)
    return [v for v, w in zip(free, waits) if w <= soonest + slack_s]


class ProactiveDispatch(DispatchPolicy):
    """Shortest estimated pending time among replicas that are not overloaded (dLoRA), and with
    `start_slack_s`, among those of them that would start the request soonest."""

    name = "proactive"
    prices_work = True

    def __init__(self, kv_high: float = KV_HIGH, start_slack_s: float | None = None) -> None:
        self.kv_high = kv_high
        self.start_slack_s = start_slack_s

    def choose(self, replicas, req, params):
        eligible = self._eligible(replicas, req)
        calm = [v for v in eligible if v.kv_fraction < self.kv_high] or eligible
        if self.start_slack_s is not None:
            calm = soonest_starts(calm, req, params, self.start_slack_s, self.kv_high)
        decisions = [self._decide(v, req, params) for v in calm]
        return min(decisions, key=lambda d: (d.pending_s, d.load_adapter, d.replica_id))


class RoundRobinDispatch(DispatchPolicy):
    """Cycle over the replicas holding the adapter (all of them for the base model); a static
    placement baseline: it never loads an adapter when some replica holds it."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, replicas, req, params):
        eligible = self._eligible(replicas, req)
        holders = [v for v in eligible if v.holds(req.adapter)] or eligible
        pick = sorted(holders, key=lambda v: v.replica_id)[next(self._counter) % len(holders)]
        return self._decide(pick, req, params)


class LeastLoadedDispatch(DispatchPolicy):
    """Fewest unfinished requests, adapter-blind (what the router did before dLoRA dispatch)."""

    name = "least_loaded"

    def choose(self, replicas, req, params):
        pick = min(self._eligible(replicas, req), key=lambda v: (v.num_requests, v.replica_id))
        return self._decide(pick, req, params)


DISPATCH_POLICIES: dict[str, type[DispatchPolicy]] = {
    cls.name: cls for cls in (ProactiveDispatch, RoundRobinDispatch, LeastLoadedDispatch)
}


def make_dispatch_policy(name: str, start_slack_s: float | None = None) -> DispatchPolicy:
    """The policy `name`; `start_slack_s` is proactive dispatch's (see the module docstring)."""
    if name == ProactiveDispatch.name:
        return ProactiveDispatch(start_slack_s=start_slack_s)
    try:
        return DISPATCH_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}: supported are {', '.join(DISPATCH_POLICIES)}") from None

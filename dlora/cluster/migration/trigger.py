"""When to run a co-migration round (dLoRA §5.2 "Selective migration").

Why triggers at all: migration aborts running requests and re-prefills them, so it only pays
under real imbalance. The authors' artifact checked every 10 s and migrated when one replica's
KV use was at least 90% while another's was below 90%, or when request counts differed by more
than 16; the paper adds queueing delay beyond a threshold. Each condition needs a replica that
can absorb work, so a uniformly saturated cluster does not churn. Time is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlora.cluster.policy_views import ReplicaView


@dataclass(frozen=True, slots=True)
class TriggerConfig:
    interval_s: float = 10.0  # at most one round per interval
    kv_high: float = 0.90  # fire when one replica is at or above this and another below it
    count_imbalance: int = 16  # fire when max - min unfinished requests is strictly above this
    queue_delay_s: float = 2.0  # fire when a queued request has waited at least this long ...
    # ... while another replica's oldest queued request has waited less (or nothing is queued)


@dataclass(frozen=True, slots=True)
class Trigger:
    reason: str  # "kv" | "count" | "queue_delay"
    overloaded: int  # replica_id that fired it
    detail: str


def oldest_wait(view: ReplicaView, now: float) -> float:
    """Seconds the longest-queued request on the replica has waited there (0 when none is queued);
    a moved request's wait starts again when its new replica is sent it."""
    return max((now - r.queued_since for r in view.requests if not r.running), default=0.0)


def check_trigger(
    replicas: Sequence[ReplicaView], now: float, last_run: float | None, cfg: TriggerConfig | None = None
) -> Trigger | None:
    """The first condition that fires (kv, then count, then queue delay), or None."""
    cfg = cfg or TriggerConfig()
    views = [v for v in replicas if v.healthy]
    if len(views) < 2 or (last_run is not None and now - last_run < cfg.interval_s):
        return None
    kv = max(views, key=lambda v: v.kv_fraction)
    if kv.kv_fraction >= cfg.kv_high and min(v.kv_fraction for v in views) < cfg.kv_high:
        return Trigger("kv", kv.replica_id, f"KV {kv.kv_fraction:.1%} >= {cfg.kv_high:.0%}")
    most, least = max(views, key=lambda v: v.num_requests), min(views, key=lambda v: v.num_requests)
    if most.num_requests - least.num_requests > cfg.count_imbalance:
        return Trigger(
            "count", most.replica_id, f"{most.num_requests} - {least.num_requests} requests > {cfg.count_imbalance}"
        )
    waits = [(oldest_wait(v, now), v.replica_id) for v in views]
    worst, best = max(waits), min(waits)
    if worst[0] >= cfg.queue_delay_s and best[0] < cfg.queue_delay_s:
        return Trigger("queue_delay", worst[1], f"queued {worst[0]:.2f} s >= {cfg.queue_delay_s} s")
    return None

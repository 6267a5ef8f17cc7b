"""`cluster.autoscale` = Aladdin's replica autoscaling. Its checks raise ValueError (the autoscaler
and simulators build it outside a config file); `cluster:` turns them into ConfigErrors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from dlora.kinds import kind_error


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """`cluster.autoscale`: Aladdin's replica autoscaling (dlora/cluster/autoscale.py, docs/autoscaling.md)."""

    min_replicas: int = 1
    max_replicas: int = 1
    heartbeat_s: float = 5.0  # a decision per heartbeat; the sample covers the heartbeat before it
    rate_window_s: float = 30.0  # the arrival rate is measured over this many seconds of heartbeats
    min_arrivals: int = 20  # Aladdin's floor R, in requests per rate window: fewer and the rate is noise
    extra_replicas: int = 0  # c of the rule
    min_finished: int = 32  # finished requests before their mean output length turns tokens into requests
    target_utilization: float = 0.8  # plan each replica this full
    capacity_rps_prior: float | None = None  # requests/s one replica serves, until measured
    min_attainment: float = 0.95  # reactive: below this in a window, one more replica
    max_queue_wait_s: float = 2.0  # reactive: a mean queue wait above this, one more replica
    hysteresis: float = 0.2  # scale in only if N - 1 replicas would carry this much more load
    scale_out_cooldown_s: float = 15.0
    scale_in_cooldown_s: float = 60.0
    frontier_points: int = 32  # the most recent saturated heartbeats the rule is fitted on
    # A draining replica's requests still there after this long fail over when it stops.
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        why = kind_error(self, "cluster.autoscale")
        if why:
            raise ValueError(why)
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise ValueError(
                f"cluster.autoscale.min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                "need 1 <= min_replicas <= max_replicas"
            )
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"autoscale target_utilization {self.target_utilization}: must be in (0, 1]")
        for key in ("heartbeat_s", "rate_window_s", "drain_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"cluster.autoscale.{key}={getattr(self, key)!r}: must be > 0")
        for key in ("scale_out_cooldown_s", "scale_in_cooldown_s", "hysteresis", "max_queue_wait_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"cluster.autoscale.{key}={getattr(self, key)!r}: must be >= 0")
        for key in ("min_arrivals", "min_finished", "extra_replicas"):
            if getattr(self, key) < 0:
                raise ValueError(f"cluster.autoscale.{key}={getattr(self, key)!r}: must be a whole number >= 0")
        if self.frontier_points < 1:
            raise ValueError(f"cluster.autoscale.frontier_points={self.frontier_points!r}: must be a whole number >= 1")
        if not 0 <= self.min_attainment <= 1:
            raise ValueError(f"cluster.autoscale.min_attainment={self.min_attainment!r}: must be in [0, 1]")
        if self.capacity_rps_prior is not None and self.capacity_rps_prior <= 0:
            raise ValueError(f"cluster.autoscale.capacity_rps_prior={self.capacity_rps_prior!r}: must be > 0 or null")


def parse_autoscale(data: Mapping[str, object]) -> AutoscaleConfig:
    """`cluster.autoscale` from its YAML mapping; ValueError names an unknown or bad key."""
    known = {f.name for f in fields(AutoscaleConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"cluster.autoscale: unknown key(s) {unknown}; known: {sorted(known)}")
    return AutoscaleConfig(**data)  # type: ignore[arg-type]  # kinds are checked in __post_init__

"""`cluster:` = the replicas and what runs between them: dispatch, placement, migration, failure
handling, expected output lengths and autoscaling. The checks are grouped by topic below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlora.config.autoscale import AutoscaleConfig, parse_autoscale
from dlora.config.checks import ConfigError, check, check_kinds

DISPATCH_MODES = ("proactive", "slo_feasible", "best_fit", "least_loaded", "round_robin")


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 1
    # Join an existing Ray cluster at this address; None starts a local one bound to 127.0.0.1.
    ray_address: str | None = None
    # CPU cores to pin replicas to, `cores_per_replica` per replica in order (CPU only); empty
    # means the cores this process may use, in order.
    cpu_cores: tuple[int, ...] = ()
    # Cores (and engine threads) per CPU replica. 1: one single-threaded engine per core, which
    # on a 2-core machine serves more than one two-thread engine (bench/overhead/runs/).
    cores_per_replica: int = 1
    # A custom Ray resource each replica needs, by position (replica i: the i-th name, wrapping
    # around; a small share of one unit): nodes started with `--resources='{"gpu_a": 1}'` take the
    # replicas named for them. Empty: Ray places replicas wherever their CPUs or GPU are free.
    replica_resources: tuple[str, ...] = ()
    # proactive (shortest estimated pending time, dLoRA) | slo_feasible (the least pending time among
    # replicas where every request keeps its SLO, Aladdin) | best_fit (the fullest replica where they
    # do, so others stay idle) | least_loaded | round_robin
    dispatch: str = "proactive"
    # With proactive dispatch: only replicas that would start a request within this many seconds of
    # the soonest one (a free running slot and KV room, the end of their engine step under way, its
    # adapter's load) are compared by pending time. null: pending time alone (dLoRA's dispatch).
    dispatch_start_slack_s: float | None = 0.05
    # proactive, slo_feasible and best_fit: price the prefill a replica's prefix cache would save
    # (the router's record of what it sent where, cluster/prefix_locality.py), so a conversation's
    # next turn goes back to the replica holding its history while that replica keeps up. Needs
    # engine.enable_prefix_caching; least_loaded and round_robin stay blind to it.
    prefix_aware_dispatch: bool = True
    # dynamic: adapters are loaded wherever dispatch sends their requests; static: each adapter
    # lives on one replica (registry id mod N) and its requests only go there (a baseline).
    placement: str = "dynamic"
    migration: bool = True  # reactive request-adapter co-migration between replicas
    migration_interval_s: float = 10.0  # at most one migration round per interval
    # fixed: co-migration rounds only when a trigger fires (at most one per migration_interval_s)
    # and the preload every placement_interval_s; adaptive: besides, a planned round and preload
    # every period, which SeaLLM's Eq. 8 shortens by 10% when the period's arrival rate and SLO
    # attainment differ from the last period's by more than 10% and lengthens by 10% otherwise
    # (within [reoptimize_min_s, reoptimize_max_s]); the triggers stay, as emergency rounds.
    reoptimize: str = "fixed"
    reoptimize_min_s: float = 5.0
    reoptimize_max_s: float = 120.0
    migration_solver: str = "auto"  # auto (HiGHS if installed, else CBC) | highs | cbc | greedy
    migration_time_limit_s: float = 0.05  # hard limit on one solve; greedy fallback after it
    migration_top_k: int = 2  # overloaded and underloaded replicas considered per round
    # A round that moves running requests runs only when, simulated over this many draws of the
    # output lengths, it lowers the touched replicas' summed completion time (their recompute
    # included; dlora/cluster/migration/simulated_gain.py). 0: every planned round runs.
    migration_check_draws: int = 16
    count_imbalance: int = 16  # trigger: unfinished-request counts differ by more than this
    queue_delay_s: float = 2.0  # trigger: a queued request waited this long while another replica is idle
    # With `migration`: on every monitor tick, requests queued on a replica at least
    # `queued_min_wait_s` (None = monitor_interval_s) move to replicas that can start them now.
    migrate_queued: bool = True
    queued_min_wait_s: float | None = None
    # With `migrate_queued`: when no replica can start them, queued requests also move between busy
    # replicas where that lowers the replicas' summed estimated queue wait by at least this many
    # seconds (dlora/cluster/migration/rebalance.py); null (the default) turns these moves off:
    # on the two-replica benchmark they did not lower queueing (bench/README.md).
    rebalance_min_gain_s: float | None = None
    # With `migrate_queued`: queued-request moves also run on events, between monitor ticks: when a
    # request's stream ends (its replica may have a free slot) and when a request has waited this
    # many seconds; only requests queued at least this long move. null: on ticks only.
    event_moves_min_wait_s: float | None = 0.1
    monitor_interval_s: float = 1.0  # how often replica stats are read
    # A request whose replica fails is resubmitted elsewhere at most this many times, then failed
    # (so a request that kills replicas cannot cycle restarts through the cluster).
    max_resubmissions: int = 2
    # Deadline on every call to a replica actor other than a request's stream (stats, adapter
    # loads, aborts); a replica that misses it is pinged (an answer that does not wait for the
    # engine), and treated as failed if the ping misses the deadline too.
    actor_call_timeout_s: float = 30.0
    # A replica whose pings answer is busy, not dead (one engine step can outlast the deadline:
    # a long prefill on one core); a call it leaves unanswered this long means its engine hangs.
    replica_stall_timeout_s: float = 300.0
    # Deadline on building a replica's engine (start and rebuild after a failure).
    replica_start_timeout_s: float = 600.0
    # A replica that fails to rebuild this many times in a row is reported unhealthy and left alone.
    max_restart_attempts: int = 5
    placement_interval_s: float = 30.0  # long-term preload period (dynamic placement), also its rate window
    # Output lengths dispatch and migration expect (dlora/cluster/estimators/output_lengths.py): each adapter's
    # last `output_length_window` finished requests (0 = price every request at its max_tokens);
    # an adapter's own history counts from `output_length_min_samples` on, before that every
    # adapter's pooled history, and before any request finished `output_length_prior` tokens
    # (None = max_tokens).
    output_length_window: int = 256
    output_length_min_samples: int = 8
    output_length_prior: int | None = None
    # Aladdin's replica autoscaling (dlora/cluster/autoscale.py, docs/autoscaling.md): a mapping of
    # its settings ({min_replicas, max_replicas, ...}); null: a fixed num_replicas. num_replicas
    # is then the count it starts with.
    autoscale: AutoscaleConfig | None = None

    def __post_init__(self) -> None:
        check_kinds(self, "cluster")
        object.__setattr__(self, "autoscale", _autoscale_of(self.autoscale))
        _check_replicas(self)
        _check_dispatch(self)
        _check_migration(self)
        _check_failures(self)
        _check_output_lengths(self)

    @property
    def queued_wait_s(self) -> float:
        """How long a request must have queued before it may move (`queued_min_wait_s` resolved)."""
        return self.monitor_interval_s if self.queued_min_wait_s is None else float(self.queued_min_wait_s)


def _autoscale_of(value: Any) -> AutoscaleConfig | None:
    """`cluster.autoscale` as the autoscaler takes it: YAML and overrides give a mapping."""
    if isinstance(value, dict):
        try:
            return parse_autoscale(value)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
    if value is not None and not isinstance(value, AutoscaleConfig):
        raise ConfigError(f"cluster.autoscale={value!r}: must be a mapping or null")
    return value


def _check_replicas(c: ClusterConfig) -> None:
    """How many replicas, on how many cores each; with autoscaling, the count it starts with."""
    if c.autoscale is not None:
        a = c.autoscale
        check(
            a.min_replicas <= c.num_replicas <= a.max_replicas,
            "cluster.num_replicas",
            c.num_replicas,
            f"must be within cluster.autoscale's min_replicas..max_replicas ({a.min_replicas}..{a.max_replicas})",
        )
        check(
            c.placement == "dynamic",
            "cluster.placement",
            c.placement,
            "must be dynamic with cluster.autoscale (static placement maps adapters to a fixed replica count)",
        )
    check(c.num_replicas >= 1, "cluster.num_replicas", c.num_replicas, "must be >= 1")
    check(c.cores_per_replica >= 1, "cluster.cores_per_replica", c.cores_per_replica, "must be >= 1")


def _check_dispatch(c: ClusterConfig) -> None:
    """Where a new request goes, and where adapters may live."""
    check(c.dispatch in DISPATCH_MODES, "cluster.dispatch", c.dispatch, f"must be one of {', '.join(DISPATCH_MODES)}")
    check(c.placement in ("dynamic", "static"), "cluster.placement", c.placement, "must be dynamic or static")
    check(
        c.dispatch_start_slack_s is None or c.dispatch_start_slack_s >= 0,
        "cluster.dispatch_start_slack_s",
        c.dispatch_start_slack_s,
        "must be a number of seconds >= 0, or null (pending time alone)",
    )
    check(c.placement_interval_s > 0, "cluster.placement_interval_s", c.placement_interval_s, "must be > 0")


def _check_migration(c: ClusterConfig) -> None:
    """Co-migration rounds, their triggers and period, and queued-request moves."""
    check(c.reoptimize in ("fixed", "adaptive"), "cluster.reoptimize", c.reoptimize, "must be fixed or adaptive")
    check(
        c.reoptimize == "fixed" or c.reoptimize_min_s <= c.migration_interval_s <= c.reoptimize_max_s,
        "cluster.reoptimize_min_s",
        (c.reoptimize_min_s, c.migration_interval_s, c.reoptimize_max_s),
        "need reoptimize_min_s <= migration_interval_s (the first period) <= reoptimize_max_s",
    )
    check(
        c.migration_solver in ("auto", "highs", "cbc", "greedy"),
        "cluster.migration_solver",
        c.migration_solver,
        "must be one of auto, highs, cbc, greedy",
    )
    for key in (
        "migration_interval_s",
        "reoptimize_min_s",
        "reoptimize_max_s",
        "migration_time_limit_s",
        "queue_delay_s",
    ):
        check(getattr(c, key) > 0, f"cluster.{key}", getattr(c, key), "must be > 0")
    check(c.migration_top_k >= 1, "cluster.migration_top_k", c.migration_top_k, "must be >= 1")
    check(c.migration_check_draws >= 0, "cluster.migration_check_draws", c.migration_check_draws, "must be >= 0")
    check(
        c.queued_min_wait_s is None or c.queued_min_wait_s >= 0,
        "cluster.queued_min_wait_s",
        c.queued_min_wait_s,
        "must be a number of seconds >= 0, or null (= cluster.monitor_interval_s)",
    )
    check(
        c.event_moves_min_wait_s is None or c.event_moves_min_wait_s >= 0,
        "cluster.event_moves_min_wait_s",
        c.event_moves_min_wait_s,
        "must be a number of seconds >= 0, or null (on ticks only)",
    )
    check(
        c.rebalance_min_gain_s is None or c.rebalance_min_gain_s >= 0,
        "cluster.rebalance_min_gain_s",
        c.rebalance_min_gain_s,
        "must be a number of seconds >= 0, or null (off)",
    )


def _check_failures(c: ClusterConfig) -> None:
    """Watching the replicas: how often, how long a call may take, and what a failure costs."""
    for key in ("monitor_interval_s", "actor_call_timeout_s", "replica_stall_timeout_s", "replica_start_timeout_s"):
        check(getattr(c, key) > 0, f"cluster.{key}", getattr(c, key), "must be > 0")
    check(c.max_resubmissions >= 0, "cluster.max_resubmissions", c.max_resubmissions, "must be a whole number >= 0")
    check(
        c.max_restart_attempts >= 1,
        "cluster.max_restart_attempts",
        c.max_restart_attempts,
        "must be a whole number >= 1",
    )


def _check_output_lengths(c: ClusterConfig) -> None:
    """The output lengths dispatch and migration expect."""
    check(
        c.output_length_window >= 0,
        "cluster.output_length_window",
        c.output_length_window,
        "must be a whole number >= 0 (0 = use max_tokens)",
    )
    check(
        c.output_length_min_samples >= 1,
        "cluster.output_length_min_samples",
        c.output_length_min_samples,
        "must be a whole number >= 1",
    )
    check(
        c.output_length_prior is None or c.output_length_prior >= 1,
        "cluster.output_length_prior",
        c.output_length_prior,
        "must be a whole number of tokens >= 1, or null (= each request's max_tokens)",
    )

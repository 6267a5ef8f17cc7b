"""What the router is configured with (built from the `cluster:` and `engine:` sections by
dlora/server/state.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlora.cluster.estimators.output_lengths import OutputLengthConfig
from dlora.cost.params import MERGED_RATIO_PRIOR
from dlora.slo.config import SloConfig


@dataclass(frozen=True)
class RouterConfig:
    dispatch: str = "proactive"
    # proactive dispatch compares by pending time only the replicas that would start a request
    # within this many seconds of the soonest (cluster.dispatch_start_slack_s); None: all of them
    dispatch_start_slack_s: float | None = None
    # the dispatch modes that price work count the prefill a replica's prefix cache saves
    # (cluster.prefix_aware_dispatch and engine.enable_prefix_caching)
    prefix_aware: bool = False
    # static: each adapter lives on one replica (id mod N) and only goes there — the baseline
    # placement dLoRA compares against; dynamic: any replica, adapters loaded where needed.
    static_placement: bool = False
    adapter_slots: int = 4  # adapters one replica may hold at once (vLLM max_cpu_loras)
    # Bytes of adapter weights one replica's host cache may hold (engine.max_cpu_lora_mib); the
    # router then unloads least recently used adapters itself. None: vLLM's count LRU alone.
    host_cache_bytes: int | None = None
    batch_adapter_slots: int = 1 << 20  # distinct adapters in one engine step (vLLM max_loras)
    kv_capacity_tokens: int = 1 << 17  # per replica until its engine's stats report the real one
    max_batch: int = 64  # requests one engine step may run (vLLM max_num_seqs)
    # merged step cost / unmerged until a replica's merged steps are measured: the engines' LoRA
    # backend's prior (scheduling.merged_cost_ratio), so dispatch and batch plans price merging alike
    merged_ratio_prior: float = MERGED_RATIO_PRIOR
    # Output lengths the balancer expects (dispatch, migration): per-adapter history of finished requests.
    output_lengths: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    max_resubmissions: int = 2  # replica failures a request survives (migrations don't count)
    actor_call_timeout_s: float = 30.0  # every replica call but a stream; missed: the replica is pinged
    # A call a replica that still answers pings has left unanswered this long: its engine hangs.
    replica_stall_timeout_s: float = 300.0
    replica_start_timeout_s: float = 600.0  # building a replica's engine
    max_restart_attempts: int = 5  # failed rebuilds in a row before a replica is given up
    request_timeout_s: float | None = None  # a request's deadline from arrival (None: none)
    # With no replica up, how long a request waits for one to come back before NoReplicaError.
    recovery_grace_s: float = 3.0
    # The default SLO finished requests are judged against (`slo:`; adapters may have their own).
    slo: SloConfig = field(default_factory=SloConfig)

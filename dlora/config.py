"""Frozen configuration dataclasses, filled from YAML and overridden by CLI flags.

One tree: `DloraConfig` holds `ModelConfig`, `EngineConfig`, `ServerConfig`, `ClusterConfig`,
`SchedulingConfig`, `SloTargetsConfig` and the adapters registered at start. Relative paths in a
YAML file are resolved against the directory of that file, so `dlora serve --config X` works from
anywhere.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from dlora import env
from dlora.kinds import kind_error
from dlora.scheduling import BatchingConfig, policy_names
from dlora.slo.config import AdapterSlo, SloConfig, parse_adapter_slo

DEFAULT_MODEL = "auto:smollm2-135m-instruct"
DISPATCH_MODES = ("proactive", "slo_feasible", "best_fit", "least_loaded", "round_robin")
DTYPES = ("bfloat16", "float16", "float32", "auto")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the bad value."""


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


def _as_config_error(check: Callable[[], Any]) -> None:
    """Run a check written outside this module (it raises ValueError naming the key) so that its
    failure is a ConfigError like every other bad value here."""
    try:
        check()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_kinds(obj: Any, section: str) -> None:
    """First in every section's __post_init__: a value of the wrong kind (YAML, override or
    constructor) is named before a range check meets it (dlora/kinds.py)."""
    why = kind_error(obj, section)
    if why:
        raise ConfigError(why)


@dataclass(frozen=True)
class ModelConfig:
    # A directory in Hugging Face layout, or "auto:<name>" for a model dlora prepares itself.
    path: str = DEFAULT_MODEL
    # The name clients put in `model` for the base model; defaults to the directory name.
    served_name: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    seed: int = 0
    # Sampling defaults for requests that leave a parameter out (vLLM's --generation-config): "auto" =
    # the model's generation_config.json, "vllm" = vLLM's neutral defaults, else a directory holding one.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        _check_kinds(self, "model")
        _check(self.dtype in DTYPES, "model.dtype", self.dtype, f"must be one of {DTYPES}")
        _check(self.max_model_len > 0, "model.max_model_len", self.max_model_len, "must be > 0")
        _check(
            self.generation_config != "",
            "model.generation_config",
            self.generation_config,
            "must be auto, vllm or a directory holding generation_config.json",
        )


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class EngineConfig:
    max_loras: int = 4  # adapters in one batch (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int = 16  # adapters kept in host memory, LRU beyond that
    # MiB of adapter weights each replica's host cache may hold (the router unloads the least
    # recently used unpinned adapter without requests in flight); None: max_cpu_loras alone
    max_cpu_lora_mib: float | None = None
    kv_cache_space_gib: int = 1  # vLLM CPU reads whole GiB (VLLM_CPU_KVCACHE_SPACE)
    # KV blocks per replica (vLLM's num_gpu_blocks_override): a finer cap than whole GiB, e.g. to
    # give each replica a fixed token budget; None = all of kv_cache_space_gib
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    lora_backend: str = "vllm"
    enforce_eager: bool = True
    # Read a cold adapter's files in a background thread of the engine, so running requests keep
    # stepping while it loads. Off by default: on a 2-core CPU the read holds a step up by about one
    # step, while the thread's extra engine round trips make the cold request's first token ~1.2x
    # later (bench/cold_load); it pays where a read takes many steps (large adapters, cold disks, GPUs).
    prefetch_adapters: bool = False
    # MiB of merged weights each replica keeps for adapters merged before (LRU), so merging one of
    # them again is a swap (~1-2 ms on one core) instead of a reload (0.1-1 s with SmolLM2-135M).
    # One adapter on all seven projections of SmolLM2-135M in bf16 is 212 MB: 1024 keeps four.
    merged_cache_mib: float = 1024
    # vLLM's structured-output engine (--structured-outputs-config.backend): auto, xgrammar,
    # guidance, outlines or lm-format-enforcer
    structured_outputs_backend: str = "auto"
    # JSON outputs with no whitespace between tokens (--structured-outputs-config.disable_any_whitespace):
    # a model that was not trained for JSON may otherwise emit whitespace until max_tokens
    structured_outputs_disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        _check_kinds(self, "engine")
        _check(
            self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
            "engine.structured_outputs_backend",
            self.structured_outputs_backend,
            f"must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}",
        )
        _check(
            not self.structured_outputs_disable_any_whitespace
            or self.structured_outputs_backend in ("xgrammar", "guidance"),
            "engine.structured_outputs_disable_any_whitespace",
            self.structured_outputs_disable_any_whitespace,
            "needs engine.structured_outputs_backend xgrammar or guidance (vLLM's rule)",
        )
        _check(self.merged_cache_mib >= 0, "engine.merged_cache_mib", self.merged_cache_mib, "must be >= 0")
        _check(self.max_loras >= 1, "engine.max_loras", self.max_loras, "must be >= 1")
        _check(
            self.max_cpu_lora_mib is None or self.max_cpu_lora_mib > 0,
            "engine.max_cpu_lora_mib",
            self.max_cpu_lora_mib,
            "must be a number of MiB > 0, or null (count adapters only: engine.max_cpu_loras)",
        )
        _check(
            self.max_lora_rank in (1, 8, 16, 32, 64, 128, 256, 320, 512),
            "engine.max_lora_rank",
            self.max_lora_rank,
            "vLLM accepts 1, 8, 16, 32, 64, 128, 256, 320 or 512",
        )
        _check(
            self.max_cpu_loras >= self.max_loras,
            "engine.max_cpu_loras",
            self.max_cpu_loras,
            f"must be >= engine.max_loras ({self.max_loras})",
        )
        _check(
            self.kv_cache_space_gib > 0,
            "engine.kv_cache_space_gib",
            self.kv_cache_space_gib,
            "must be a whole number of GiB > 0",
        )
        _check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            "engine.num_kv_blocks",
            self.num_kv_blocks,
            "must be >= 2 (vLLM keeps one block empty)",
        )
        _check(self.max_num_seqs >= 1, "engine.max_num_seqs", self.max_num_seqs, "must be >= 1")
        _check(
            self.lora_backend in ("vllm", "triton", "einsum"),
            "engine.lora_backend",
            self.lora_backend,
            "must be one of vllm, triton, einsum",
        )
        # dlora's punica wrappers rebuild their batch metadata in Python every step (host syncs,
        # per-call allocations); CUDA graphs would replay the first step's metadata for every batch.
        _check(
            self.lora_backend == "vllm" or self.enforce_eager,
            "engine.lora_backend",
            self.lora_backend,
            "needs engine.enforce_eager: true (its per-step batch metadata cannot be captured in "
            "CUDA graphs or torch.compile); use lora_backend: vllm for CUDA graphs",
        )


def _is_s3_uri(uri: str) -> bool:
    return uri.startswith("s3://") and bool(uri[5:].split("/", 1)[0])


def _api_keys(value: Any) -> tuple[str, ...]:
    """server.api_key as the tuple it is kept as: YAML and overrides give one key, a list of keys,
    or null (no key: the routes are open)."""
    if value is None:
        return ()
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, tuple | list) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"server.api_key={value!r}: must be a non-empty string, a list of them, or null")
    return tuple(keys)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token for the admin endpoints; None: they take the API key, or are open without one
    # (DLORA_ADMIN_TOKEN overrides).
    admin_token: str | None = None
    # Adapter paths given to the admin API must resolve under one of these directories.
    adapter_roots: tuple[str, ...] = ()
    # A request naming an adapter nobody registered looks for `<root>/<name>` under adapter_roots and
    # registers what it finds as an admin call would (off: such a name is a 404, as in vLLM by default).
    resolve_adapters: bool = False
    # With resolve_adapters, also look in an S3-compatible object store: s3://bucket[/prefix], where
    # <prefix>/<name>/ holds adapter_config.json and adapter_model.safetensors (AWS_* env credentials).
    adapter_s3_uri: str | None = None
    adapter_s3_endpoint_url: str | None = None  # e.g. http://minio:9000; None: AWS's own endpoint
    # Where the adapter registry is persisted so registrations survive a restart.
    state_dir: str = "~/.cache/dlora/state"
    log_level: str = "info"
    # Bearer tokens every /v1 route needs, any one of them (vLLM's --api-key); YAML
    # gives one key or a list; empty = open. DLORA_API_KEY (one key) overrides. Separate from admin_token.
    api_key: tuple[str, ...] = ()
    # A request's own `chat_template` (in chat_template_kwargs or the body) is a Jinja program run by
    # the server: refused unless the operator trusts every client (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # The chat template that replaces the tokenizer's (vLLM's --chat-template): a file, or the template
    # itself when it holds `{`, `}` or a newline; None = the tokenizer's own.
    chat_template: str | None = None
    # vLLM's parser that turns a model's tool-call text into `tool_calls` (--tool-call-parser), by name.
    tool_call_parser: str | None = None
    # Let the model decide when to call a tool (`tool_choice: auto`; --enable-auto-tool-choice). As in
    # vLLM it needs tool_call_parser, which reads the calls out of the model's text.
    enable_auto_tool_choice: bool = False
    # vLLM's parser that separates a reasoning model's thinking into `reasoning_content` (--reasoning-parser).
    reasoning_parser: str | None = None
    # Seconds one request's chat-template rendering + tokenisation may take (off the event loop).
    template_timeout_s: float = 5.0
    # /v1/models shows each card's path as vLLM does (`root`: the model's and adapters' directories);
    # off, `root` is the card's name, so clients learn nothing of the server's file layout.
    show_model_paths: bool = False
    # Client `priority` is honoured only when this is on; else a non-zero priority is refused (400),
    # as vLLM does when its scheduling policy is not `priority`.
    allow_client_priority: bool = False
    # Admission control (what a client sees when one is hit: docs/operating.md).
    max_body_bytes: int = 8 * 1024 * 1024  # request body size; larger -> 413
    max_choices_per_request: int = 256  # prompts x n of one request; more -> 400
    max_pending_requests: int = 4096  # engine requests (choices) in flight in the cluster; more -> 429
    request_timeout_s: float | None = 600.0  # a request's deadline from arrival; None = none
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT: how long in-flight streams may still run

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", _api_keys(self.api_key))
        _check_kinds(self, "server")
        _check(0 <= self.port < 65536, "server.port", self.port, "must be a TCP port (0-65535)")
        _check(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "server.enable_auto_tool_choice",
            self.enable_auto_tool_choice,
            "needs server.tool_call_parser (--tool-call-parser), as vLLM's --enable-auto-tool-choice does",
        )
        _check(
            self.adapter_s3_uri is None or _is_s3_uri(self.adapter_s3_uri),
            "server.adapter_s3_uri",
            self.adapter_s3_uri,
            "must be s3://bucket or s3://bucket/prefix",
        )
        _check(self.template_timeout_s > 0, "server.template_timeout_s", self.template_timeout_s, "must be > 0")
        for key in ("max_body_bytes", "max_choices_per_request", "max_pending_requests"):
            _check(getattr(self, key) >= 1, f"server.{key}", getattr(self, key), "must be a whole number >= 1")
        _check(
            self.request_timeout_s is None or self.request_timeout_s > 0,
            "server.request_timeout_s",
            self.request_timeout_s,
            "must be a number of seconds > 0, or null (no deadline)",
        )
        _check(self.drain_timeout_s >= 0, "server.drain_timeout_s", self.drain_timeout_s, "must be >= 0")
        _check(
            self.log_level in LOG_LEVELS, "server.log_level", self.log_level, f"must be one of {', '.join(LOG_LEVELS)}"
        )


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
    # proactive (shortest estimated pending time, dLoRA) | slo_feasible (the least pending time among
    # replicas where every request keeps its SLO, Aladdin) | best_fit (the fullest replica where they
    # do, so others stay idle) | least_loaded | round_robin
    dispatch: str = "proactive"
    # With proactive dispatch: only replicas that would start a request within this many seconds of
    # the soonest one (a free running slot and KV room, the end of their engine step under way, its
    # adapter's load) are compared by pending time. null: pending time alone (dLoRA's dispatch).
    dispatch_start_slack_s: float | None = 0.05
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
        _check_kinds(self, "cluster")
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
        _check(
            a.min_replicas <= c.num_replicas <= a.max_replicas,
            "cluster.num_replicas",
            c.num_replicas,
            f"must be within cluster.autoscale's min_replicas..max_replicas ({a.min_replicas}..{a.max_replicas})",
        )
        _check(
            c.placement == "dynamic",
            "cluster.placement",
            c.placement,
            "must be dynamic with cluster.autoscale (static placement maps adapters to a fixed replica count)",
        )
    _check(c.num_replicas >= 1, "cluster.num_replicas", c.num_replicas, "must be >= 1")
    _check(c.cores_per_replica >= 1, "cluster.cores_per_replica", c.cores_per_replica, "must be >= 1")


def _check_dispatch(c: ClusterConfig) -> None:
    """Where a new request goes, and where adapters may live."""
    _check(c.dispatch in DISPATCH_MODES, "cluster.dispatch", c.dispatch, f"must be one of {', '.join(DISPATCH_MODES)}")
    _check(c.placement in ("dynamic", "static"), "cluster.placement", c.placement, "must be dynamic or static")
    _check(
        c.dispatch_start_slack_s is None or c.dispatch_start_slack_s >= 0,
        "cluster.dispatch_start_slack_s",
        c.dispatch_start_slack_s,
        "must be a number of seconds >= 0, or null (pending time alone)",
    )
    _check(c.placement_interval_s > 0, "cluster.placement_interval_s", c.placement_interval_s, "must be > 0")


def _check_migration(c: ClusterConfig) -> None:
    """Co-migration rounds, their triggers and period, and queued-request moves."""
    _check(c.reoptimize in ("fixed", "adaptive"), "cluster.reoptimize", c.reoptimize, "must be fixed or adaptive")
    _check(
        c.reoptimize == "fixed" or c.reoptimize_min_s <= c.migration_interval_s <= c.reoptimize_max_s,
        "cluster.reoptimize_min_s",
        (c.reoptimize_min_s, c.migration_interval_s, c.reoptimize_max_s),
        "need reoptimize_min_s <= migration_interval_s (the first period) <= reoptimize_max_s",
    )
    _check(
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
        _check(getattr(c, key) > 0, f"cluster.{key}", getattr(c, key), "must be > 0")
    _check(c.migration_top_k >= 1, "cluster.migration_top_k", c.migration_top_k, "must be >= 1")
    _check(c.migration_check_draws >= 0, "cluster.migration_check_draws", c.migration_check_draws, "must be >= 0")
    _check(
        c.queued_min_wait_s is None or c.queued_min_wait_s >= 0,
        "cluster.queued_min_wait_s",
        c.queued_min_wait_s,
        "must be a number of seconds >= 0, or null (= cluster.monitor_interval_s)",
    )
    _check(
        c.event_moves_min_wait_s is None or c.event_moves_min_wait_s >= 0,
        "cluster.event_moves_min_wait_s",
        c.event_moves_min_wait_s,
        "must be a number of seconds >= 0, or null (on ticks only)",
    )
    _check(
        c.rebalance_min_gain_s is None or c.rebalance_min_gain_s >= 0,
        "cluster.rebalance_min_gain_s",
        c.rebalance_min_gain_s,
        "must be a number of seconds >= 0, or null (off)",
    )


def _check_failures(c: ClusterConfig) -> None:
    """Watching the replicas: how often, how long a call may take, and what a failure costs."""
    for key in ("monitor_interval_s", "actor_call_timeout_s", "replica_stall_timeout_s", "replica_start_timeout_s"):
        _check(getattr(c, key) > 0, f"cluster.{key}", getattr(c, key), "must be > 0")
    _check(c.max_resubmissions >= 0, "cluster.max_resubmissions", c.max_resubmissions, "must be a whole number >= 0")
    _check(
        c.max_restart_attempts >= 1,
        "cluster.max_restart_attempts",
        c.max_restart_attempts,
        "must be a whole number >= 1",
    )


def _check_output_lengths(c: ClusterConfig) -> None:
    """The output lengths dispatch and migration expect."""
    _check(
        c.output_length_window >= 0,
        "cluster.output_length_window",
        c.output_length_window,
        "must be a whole number >= 0 (0 = use max_tokens)",
    )
    _check(
        c.output_length_min_samples >= 1,
        "cluster.output_length_min_samples",
        c.output_length_min_samples,
        "must be a whole number >= 1",
    )
    _check(
        c.output_length_prior is None or c.output_length_prior >= 1,
        "cluster.output_length_prior",
        c.output_length_prior,
        "must be a whole number of tokens >= 1, or null (= each request's max_tokens)",
    )


@dataclass(frozen=True)
class SchedulingConfig(BatchingConfig):
    """`scheduling:` = the batching policy's name plus its parameters (`dlora.scheduling.BatchingConfig`,
    the one definition of them, with its defaults and checks)."""

    # unmerged (vLLM's behaviour) | merged (one adapter at a time) | dlora (Algorithms 1-3)
    policy: str = "unmerged"

    def __post_init__(self) -> None:
        _as_config_error(super().__post_init__)
        _check(
            self.policy in policy_names(),
            "scheduling.policy",
            self.policy,
            f"must be one of {', '.join(policy_names())}",
        )

    def batching(self) -> BatchingConfig:
        """The policy parameters alone (what `make_policy` takes)."""
        return BatchingConfig(**{f.name: getattr(self, f.name) for f in fields(BatchingConfig)})

    def to_engine(self) -> dict[str, Any]:
        """Plain values for vLLM's `additional_config` (JSON-hashed, sent to the engine process)."""
        return {"policy": self.policy, **dataclasses.asdict(self.batching())}


@dataclass(frozen=True)
class SloTargetsConfig:
    """`slo:` = the latency targets a request is held to when its adapter has none of its own (and
    always for the base model). Requests are judged against them after they finish (attainment and
    normalized latency in /metrics: docs/metrics.md); nothing is scheduled differently."""

    # Absolute default targets in seconds, both or neither; null: SeaLLM's relative default,
    # relative_k x the request's isolated TTFT and time per output token (dlora.slo.config).
    ttft_s: float | None = None
    tpot_s: float | None = None
    relative_k: float = SloConfig.relative_k

    def __post_init__(self) -> None:
        _check_kinds(self, "slo")
        _as_config_error(self.policy)

    def policy(self) -> SloConfig:
        """The SLO policy's own config (`dlora.slo.config.SloConfig`, which checks these values)."""
        return SloConfig(ttft_s=self.ttft_s, tpot_s=self.tpot_s, relative_k=self.relative_k)


BATCH_PLANNERS = ("stages", "none")


@dataclass(frozen=True)
class BatchConfig:
    """Offline batch jobs (/v1/files, /v1/batches and `dlora batch run`)."""

    max_file_mib: float = 200.0  # an uploaded file's size; larger -> 413
    max_requests: int = 50_000  # lines in one batch's input file (OpenAI's limit); more -> the batch fails
    # The engine priority of batch requests (lower runs first; online requests are 0 unless a client
    # may set its own): queued batch work is admitted after online work and preempted before it.
    priority: int = 1_000_000
    # Batch engine requests (a line of n completions is n of them) in the engines at once while no
    # online request is in flight; None: the engines' max_num_seqs per serving replica. Online
    # requests in flight take their places one for one.
    max_in_flight: int | None = None
    # How a batch's lines are ordered over the replicas: "stages" plans which adapters run merged on
    # which replica and in what order (sample-then-simulate, dlora/batch/plan.py); "none" sends them
    # as they come, to whichever replica dispatch picks.
    planner: str = "stages"
    # With "stages": a stage plan is chosen only when predicted at least this fraction sooner than
    # sending the lines at once (else they are sent at once). Why a margin: each stage boundary
    # waits for a replica's last requests, a tail the plan's simulation prices low; on 2 CPU cores
    # no stage plan has yet beaten sending at once (docs/batch.md).
    min_stage_gain: float = 0.1
    # What one owner (an API key; dlora/server/owners.py) may keep stored: files (uploads and the
    # output/error files its batches write), their bytes, and batches (active or ended, until deleted
    # or removed). An upload or a batch past these -> 429; a batch's own results are always written.
    max_files_per_owner: int = 500
    max_stored_mib_per_owner: float = 2048.0
    max_batches_per_owner: int = 100
    # Days a file is kept after it is made (unless its upload asked otherwise: OpenAI's
    # `expires_after`) and an ended batch after it ended; then they are removed. None: kept until deleted.
    retention_days: float | None = 30.0

    def __post_init__(self) -> None:
        _check_kinds(self, "batch")
        for key in ("max_files_per_owner", "max_batches_per_owner"):
            _check(getattr(self, key) >= 1, f"batch.{key}", getattr(self, key), "must be a whole number >= 1")
        _check(
            0 < self.max_stored_mib_per_owner < float("inf"),
            "batch.max_stored_mib_per_owner",
            self.max_stored_mib_per_owner,
            "must be a finite number > 0",
        )
        _check(
            self.retention_days is None or 0 < self.retention_days < float("inf"),
            "batch.retention_days",
            self.retention_days,
            "must be a finite number > 0, or null (keep files and ended batches until they are deleted)",
        )
        _check(0 <= self.min_stage_gain < 1, "batch.min_stage_gain", self.min_stage_gain, "must be >= 0 and < 1")
        _check(self.planner in BATCH_PLANNERS, "batch.planner", self.planner, f"must be one of {BATCH_PLANNERS}")
        _check(self.max_file_mib > 0, "batch.max_file_mib", self.max_file_mib, "must be > 0")
        _check(self.max_requests >= 1, "batch.max_requests", self.max_requests, "must be a whole number >= 1")
        _check(
            self.max_in_flight is None or self.max_in_flight >= 1,
            "batch.max_in_flight",
            self.max_in_flight,
            "must be a whole number >= 1, or null (max_num_seqs per serving replica)",
        )

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_file_mib * 1024 * 1024)

    @property
    def max_stored_bytes_per_owner(self) -> int:
        return int(self.max_stored_mib_per_owner * 1024 * 1024)

    @property
    def retention_s(self) -> int | None:
        return None if self.retention_days is None else int(self.retention_days * 86400)


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    pinned: bool = False
    # Its own latency targets, {ttft_s, tpot_s} in YAML; null: the `slo:` default applies.
    slo: AdapterSlo | None = None

    def __post_init__(self) -> None:
        _check_kinds(self, "adapters")
        try:
            # YAML gives a mapping; parse_adapter_slo checks it and names the bad key (slo.<key>).
            object.__setattr__(self, "slo", parse_adapter_slo(self.slo))
        except ValueError as e:
            raise ConfigError(f"adapters.{e} (adapter {self.name!r})") from None


@dataclass(frozen=True)
class DloraConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    slo: SloTargetsConfig = field(default_factory=SloTargetsConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    adapters: tuple[AdapterSpec, ...] = ()

    def __post_init__(self) -> None:
        # Pinned adapters take entries of vLLM's host (CPU) LoRA cache (engine.max_cpu_loras) for good:
        # its LRU only evicts unpinned ones. Every engine step loads the batch's adapters, up to
        # engine.max_loras, into that cache, evicting the least recently used unpinned entry when it is
        # full; the batch's own adapters are the most recently used, so they are safe only while at
        # least max_loras entries are unpinned. With fewer, a batch of max_loras unpinned adapters evicts
        # (and deactivates) one of its own adapters to load another, and the engine dies (KeyError in
        # convert_mapping; "All items are pinned" when none is left). Unpinned adapters may outnumber
        # the cache freely: they are reloaded on demand. (Adapters pinned later through the admin API
        # take entries too, but are not known here.)
        pinned = [a.name for a in self.adapters if a.pinned]
        _check(
            len(pinned) + self.engine.max_loras <= self.engine.max_cpu_loras,
            "engine.max_cpu_loras",
            self.engine.max_cpu_loras,
            f"must be >= engine.max_loras ({self.engine.max_loras}) + the {len(pinned)} pinned adapter(s) "
            f"{pinned}, which never leave the host LoRA cache (a batch needs max_loras unpinned entries)",
        )

    @property
    def state_dir(self) -> Path:
        return Path(os.path.expanduser(self.server.state_dir))

    @property
    def admin_token(self) -> str | None:
        return env.DLORA_ADMIN_TOKEN.get() or self.server.admin_token

    @property
    def api_key(self) -> tuple[str, ...]:
        """The keys the inference routes accept, any one of them; empty = open. DLORA_API_KEY, one
        key, replaces the configured ones."""
        key = env.DLORA_API_KEY.get()
        return (key,) if key else self.server.api_key


_SECTIONS = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "server": ServerConfig,
    "cluster": ClusterConfig,
    "scheduling": SchedulingConfig,
    "slo": SloTargetsConfig,
    "batch": BatchConfig,
}


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(data).__name__}")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{section}: {e}") from None


def _resolve(path: str, base: Path) -> str:
    if path.startswith("auto:"):
        return path
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else (base / p).resolve())


def _resolve_generation_config(value: str, base: Path) -> str:
    return value if value in ("auto", "vllm") else _resolve(value, base)


def _resolve_chat_template(value: str | None, base: Path) -> str | None:
    """A template file named relative to the config file; a template written inline (it holds `{`,
    `}` or a newline, vLLM's test) or a name that is no file there (one of vLLM's built-in
    templates, or a mistake check_before_start names) is kept as written."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    p = Path(os.path.expanduser(value))
    if p.is_absolute():
        return str(p)
    candidate = base / p
    return str(candidate.resolve()) if candidate.is_file() else value


def from_dict(data: dict[str, Any], base_dir: Path | None = None) -> DloraConfig:
    """Build a config from a parsed YAML mapping; relative paths resolve against `base_dir`."""
    data = dict(data or {})
    base = base_dir or Path.cwd()
    unknown = sorted(set(data) - set(_SECTIONS) - {"adapters"})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; known: {sorted([*_SECTIONS, 'adapters'])}")
    sections = {name: _build(cls, data.get(name) or {}, name) for name, cls in _SECTIONS.items()}
    model = sections["model"]
    sections["model"] = dataclasses.replace(
        model,
        path=_resolve(model.path, base),
        generation_config=_resolve_generation_config(model.generation_config, base),
    )
    server = sections["server"]
    sections["server"] = dataclasses.replace(
        server,
        adapter_roots=tuple(_resolve(r, base) for r in server.adapter_roots),
        chat_template=_resolve_chat_template(server.chat_template, base),
    )
    adapters = []
    for i, a in enumerate(data.get("adapters") or []):
        spec = _build(AdapterSpec, a, f"adapters[{i}]")
        adapters.append(dataclasses.replace(spec, path=_resolve(spec.path, base)))
    return DloraConfig(**sections, adapters=tuple(adapters))


def load(path: str | os.PathLike | None) -> DloraConfig:
    """Load a YAML config file (None gives the built-in defaults)."""
    if path is None:
        return DloraConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    return from_dict(data, p.resolve().parent)


def override(cfg: DloraConfig, dotted: dict[str, Any]) -> DloraConfig:
    """Apply overrides such as {"server.port": 9000}; None values are ignored. A section's new values
    are applied together, so a check that relates two of its keys (engine.max_cpu_loras >=
    engine.max_loras, server.enable_auto_tool_choice with server.tool_call_parser) sees both."""
    changes: dict[str, dict[str, Any]] = {}
    for key, value in dotted.items():
        if value is None:
            continue
        section, _, name = key.partition(".")
        sub = getattr(cfg, section, None)
        # A section is a dataclass instance; `adapters` (a tuple) and unknown names are not.
        if not dataclasses.is_dataclass(sub) or isinstance(sub, type) or name not in {f.name for f in fields(sub)}:
            raise ConfigError(f"unknown config key {key!r}")
        changes.setdefault(section, {})[name] = value
    for section, values in changes.items():
        try:
            replaced: dict[str, Any] = {section: dataclasses.replace(getattr(cfg, section), **values)}
            cfg = dataclasses.replace(cfg, **replaced)
        except TypeError as e:
            raise ConfigError(f"{section}: {e}") from None
    return cfg

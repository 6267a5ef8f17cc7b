"""The router's config from dlora's: the one mapping the server and the simulators both run.

`router_config` takes the whole tree because the router reads four sections: `cluster:` (dispatch,
placement, failure handling, the output lengths it expects), `engine:` (the adapter, step and host
cache limits of the engines it sends to, and their LoRA backend's merged-cost prior),
`server.request_timeout_s` and `slo:`. A simulator that stands in for the engines describes them as
an `engine:` section, so what it runs is what a server with that config would run.
"""

from __future__ import annotations

from dlora.cluster.estimators.output_lengths import OutputLengthConfig
from dlora.cluster.host_cache import MIB
from dlora.cluster.router import RouterConfig
from dlora.config import ClusterConfig, DloraConfig


def router_config(cfg: DloraConfig) -> RouterConfig:
    """What the router needs from the config: dispatch and placement, the engines' adapter and
    batch limits, failure handling, the request deadline and the default SLO it judges finished
    requests by."""
    return RouterConfig(
        dispatch=cfg.cluster.dispatch,
        dispatch_start_slack_s=cfg.cluster.dispatch_start_slack_s,
        prefix_aware=cfg.cluster.prefix_aware_dispatch and cfg.engine.enable_prefix_caching,
        static_placement=cfg.cluster.placement == "static",
        adapter_slots=cfg.engine.max_cpu_loras,
        host_cache_bytes=None if cfg.engine.max_cpu_lora_mib is None else int(cfg.engine.max_cpu_lora_mib * MIB),
        batch_adapter_slots=cfg.engine.max_loras,
        max_batch=cfg.engine.max_num_seqs,
        merged_ratio_prior=cfg.scheduling.for_lora_backend(cfg.engine.lora_backend).merged_cost_prior,
        output_lengths=output_lengths(cfg.cluster),
        max_resubmissions=cfg.cluster.max_resubmissions,
        actor_call_timeout_s=cfg.cluster.actor_call_timeout_s,
        replica_stall_timeout_s=cfg.cluster.replica_stall_timeout_s,
        replica_start_timeout_s=cfg.cluster.replica_start_timeout_s,
        max_restart_attempts=cfg.cluster.max_restart_attempts,
        request_timeout_s=cfg.server.request_timeout_s,
        slo=cfg.slo.policy(),
    )


def output_lengths(cluster: ClusterConfig) -> OutputLengthConfig:
    """The output-length estimator's own config (`cluster.output_length_*`)."""
    return OutputLengthConfig(
        window=cluster.output_length_window,
        min_samples=cluster.output_length_min_samples,
        prior_tokens=cluster.output_length_prior,
    )

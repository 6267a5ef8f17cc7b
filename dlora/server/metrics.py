"""Prometheus metrics, all in one place, labelled by adapter ("" is the base model) or replica."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from dlora.replica.messages import SWITCH_SECONDS_BUCKETS, WEIGHT_STATES, BatchingState
from dlora.server.prefix_metrics import PrefixCacheCollector
from dlora.slo.attainment import AdapterCounts, AdapterName

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dlora_requests", "Finished requests", ["adapter", "status"], registry=r)
        self.prompt_tokens = Counter("dlora_prompt_tokens", "Prompt tokens processed", ["adapter"], registry=r)
        self.generation_tokens = Counter("dlora_generation_tokens", "Tokens generated", ["adapter"], registry=r)
        self.ttft = Histogram(
            "dlora_time_to_first_token_seconds",
            "Time to first token",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "dlora_time_per_output_token_seconds",
            "Mean time per output token after the first",
            ["adapter"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dlora_e2e_request_latency_seconds",
            "End-to-end request latency",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Observed by the router (dlora/cluster/queue_time.py) once the replicas' measurements are in.
        self.queue_time = Histogram(
            "dlora_request_queue_time_seconds",
            "Time a request waited before an engine first scheduled it, summed over the "
            "replicas it was sent to, plus time held in the router",
            ["adapter"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("dlora_requests_running", "Requests that have produced a token", ["adapter"], registry=r)
        self.waiting = Gauge(
            "dlora_requests_waiting", "Requests waiting for their first token", ["adapter"], registry=r
        )
        self.adapters_registered = Gauge("dlora_adapters_registered", "Registered adapters", registry=r)
        self.adapters_resolved = Counter(
            "dlora_adapters_resolved",
            "Lookups of an unregistered adapter name by server.resolve_adapters, by outcome",
            ["outcome"],
            registry=r,
        )
        self.adapters_resident = Gauge(
            "dlora_adapters_resident",
            "Adapters in a replica's host LoRA cache (state=host, all of them) and, of those, in its LoRA "
            "device slots (state=device)",
            ["replica", "state"],
            registry=r,
        )
        self.adapter_host_bytes = Gauge(
            "dlora_adapter_host_bytes",
            "Bytes of adapter weights (their safetensors files) in a replica's host LoRA cache",
            ["replica"],
            registry=r,
        )
        self.replica_healthy = Gauge("dlora_replica_healthy", "1 when the replica serves", ["replica"], registry=r)
        self.replica_unfinished = Gauge(
            "dlora_replica_unfinished_requests", "Requests inside the engine", ["replica"], registry=r
        )
        self.replica_kv_usage = Gauge(
            "dlora_replica_kv_usage", "Fraction of the replica's KV cache in use", ["replica"], registry=r
        )
        self.replica_kv_capacity = Gauge(
            "dlora_replica_kv_capacity_tokens", "Tokens the replica's KV cache holds", ["replica"], registry=r
        )
        self.replica_running = Gauge(
            "dlora_replica_running_requests", "Requests the engine runs", ["replica"], registry=r
        )
        self.replica_waiting = Gauge(
            "dlora_replica_waiting_requests", "Requests queued in the engine", ["replica"], registry=r
        )
        self.replica_routed = Gauge(
            "dlora_replica_routed_requests", "Requests the router has on the replica", ["replica"], registry=r
        )
        self.migration_solve = Histogram(
            "dlora_migration_solve_seconds",
            "Wall time to plan one co-migration round",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.migration_rounds = Counter(
            "dlora_migration_rounds", "Co-migration rounds run, by trigger", ["reason"], registry=r
        )
        self.preloads = Counter("dlora_adapter_preloads", "Adapters copied by the long-term preload", registry=r)
        self.admission_refused = Counter(
            "dlora_admission_refused",
            "Requests refused before any work started, by reason: unauthorized (401), body_too_large (413), "
            "invalid (400), fanout (400), overloaded (429)",
            ["reason"],
            registry=r,
        )
        self.admitted_choices = Gauge(
            "dlora_admitted_completions",
            "Completions (engine requests) of admitted "
            "requests not answered yet (server.max_pending_requests bounds it)",
            registry=r,
        )
        self.replica_gave_up = Gauge(
            "dlora_replica_gave_up",
            "1 when the replica failed cluster.max_restart_attempts rebuilds in a row (it is retried rarely)",
            ["replica"],
            registry=r,
        )
        self.replicas = Gauge(
            "dlora_replicas",
            "Replicas by state: serving, starting (added, not ready yet), draining (being removed), "
            "down (failed or rebuilding)",
            ["state"],
            registry=r,
        )
        self.scale_events = Counter(
            "dlora_scale_events",
            "Replicas the autoscaler added (direction=out) or removed (in), by the reason it decided on",
            ["direction", "reason"],
            registry=r,
        )
        self.scale_failures = Counter(
            "dlora_scale_failures",
            "Replicas the autoscaler failed to start (out) or to drain (in)",
            ["direction"],
            registry=r,
        )
        self.scale_seconds = Histogram(
            "dlora_scale_seconds",
            "Time to start a replica the autoscaler added (out), or to drain and stop one it removed (in)",
            ["direction"],
            buckets=(0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0),
            registry=r,
        )
        self.drain_moved = Counter(
            "dlora_drain_moved_requests",
            "Requests moved off replicas the autoscaler removed (queued ones resubmitted, running ones co-migrated)",
            registry=r,
        )
        self.batches = Gauge("dlora_batches", "Batches (/v1/batches) by status", ["status"], registry=r)
        self.batch_requests = Counter(
            "dlora_batch_requests", "Finished batch requests (lines), by outcome", ["outcome"], registry=r
        )
        self.batch_in_flight = Gauge("dlora_batch_in_flight", "Batch requests in the engines now", registry=r)
        self.batch_choices_in_flight = Gauge(
            "dlora_batch_choices_in_flight",
            "Completions (engine requests) of the batch requests in the engines now; at most half of "
            "server.max_pending_requests, or one line's when it alone is wider",
            registry=r,
        )
        self._replica_labels: set[str] = set()  # replicas with gauges, so a removed one's are dropped
        # Counts the router keeps (resubmissions, migrations, restarts), read at scrape time.
        self.cluster = ClusterCollector()
        r.register(self.cluster)
        # Merged/unmerged batching: the engines keep the state, refreshed on each scrape.
        self.batching = BatchingCollector()
        r.register(self.batching)
        # Per-adapter SLO attainment: the router's accounting, refreshed on each scrape.
        self.slo = SloCollector()
        r.register(self.slo)
        self.prefix = PrefixCacheCollector()
        r.register(self.prefix)

    def track(self, adapter: str, prompt_tokens: int) -> RequestTracker:
        self.prompt_tokens.labels(adapter).inc(prompt_tokens)
        self.waiting.labels(adapter).inc()
        return RequestTracker(self, adapter)

    def observe_queue_time(self, adapter: str | None, seconds: float) -> None:
        self.queue_time.labels(adapter or "").observe(seconds)

    def observe_scale_event(self, event) -> None:
        """An autoscaler change (dlora.cluster.elastic.ScaleEvent)."""
        if not event.ok:
            self.scale_failures.labels(event.direction).inc()
            return
        self.scale_events.labels(event.direction, event.reason).inc()
        self.scale_seconds.labels(event.direction).observe(event.seconds)
        self.drain_moved.inc(event.moved)

    def update_batches(self, by_status: Mapping[str, int], in_flight: int) -> None:
        """The batch gauges: batches per status (every status, zeros included), and the batch
        requests running now."""
        for status, count in by_status.items():
            self.batches.labels(status).set(count)
        self.batch_in_flight.set(in_flight)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def update_cluster(self, router, adapters_registered: int, starting: frozenset[int] = frozenset()) -> None:
        """The replica gauges from what the balancer's loop last read (`router.reported_stats()`):
        no replica call, so a scrape answers at once whatever the replicas do. `starting`: replicas
        the autoscaler is starting. A removed replica's gauges go."""
        self.adapters_registered.set(adapters_registered)
        states = dict.fromkeys(("serving", "starting", "draining", "down"), 0)
        for slot in router.slots:
            states[slot.state(slot.replica_id in starting)] += 1
        for state, n in states.items():
            self.replicas.labels(state).set(n)
        self._drop_removed({str(s.replica_id) for s in router.slots})
        for st in router.reported_stats():
            rid = str(st.replica_id)
            self.replica_healthy.labels(rid).set(1 if st.healthy else 0)
            self.replica_unfinished.labels(rid).set(st.num_unfinished)
            self.adapters_resident.labels(rid, "host").set(len(st.resident_adapter_ids))
            self.adapters_resident.labels(rid, "device").set(len(st.device_adapter_ids))
            self.adapter_host_bytes.labels(rid).set(router.host_bytes(st))
            self.batching.update(rid, st.batching if st.healthy else None)
            if st.healthy and st.batching is not None:
                self.replica_kv_usage.labels(rid).set(st.batching.kv_usage or 0.0)
                if st.batching.kv_capacity_tokens:
                    self.replica_kv_capacity.labels(rid).set(st.batching.kv_capacity_tokens)
                self.replica_running.labels(rid).set(st.batching.num_running)
                self.replica_waiting.labels(rid).set(st.batching.num_waiting)
        routed = router.routed_counts()
        for slot in router.slots:
            rid = str(slot.replica_id)
            self.replica_routed.labels(rid).set(routed.get(slot.replica_id, 0))
            self.replica_gave_up.labels(rid).set(1 if slot.gave_up else 0)
            self.cluster.restarts[rid] = slot.restarts
        self.cluster.counters = dict(router.counters)
        self.slo.update(router.slo.counts())
        self.prefix.update(router.prefix_cache, router.counters.get("locality_dispatches", 0))

    def _drop_removed(self, current: set[str]) -> None:
        for rid in self._replica_labels - current:
            for gauge in (
                self.replica_healthy,
                self.replica_unfinished,
                self.adapter_host_bytes,
                self.replica_kv_usage,
                self.replica_kv_capacity,
                self.replica_running,
                self.replica_waiting,
                self.replica_routed,
                self.replica_gave_up,
            ):
                try:
                    gauge.remove(rid)
                except KeyError:  # never set for this replica
                    pass
            for state in ("host", "device"):
                try:
                    self.adapters_resident.remove(rid, state)
                except KeyError:
                    pass
            self.batching.update(rid, None)
            self.cluster.restarts.pop(rid, None)
        self._replica_labels = current


@dataclass
class RequestTracker:
    """Per-request timing; `finish` is idempotent so every exit path may call it."""

    m: Metrics
    adapter: str
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    tokens: int = 0
    done: bool = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token = time.perf_counter()
            self.m.ttft.labels(self.adapter).observe(self.first_token - self.start)
            self.m.waiting.labels(self.adapter).dec()
            self.m.running.labels(self.adapter).inc()
        self.tokens += n
        self.m.generation_tokens.labels(self.adapter).inc(n)

    def finish(self, status: str) -> None:
        if self.done:
            return
        self.done = True
        end = time.perf_counter()
        if self.first_token is None:
            self.m.waiting.labels(self.adapter).dec()
        else:
            self.m.running.labels(self.adapter).dec()
            if self.tokens > 1:
                self.m.tpot.labels(self.adapter).observe((end - self.first_token) / (self.tokens - 1))
        self.m.e2e.labels(self.adapter).observe(end - self.start)
        self.m.requests.labels(self.adapter, status).inc()


class BatchingCollector:
    """Renders each replica's `BatchingState` (read from its engine) as Prometheus families.

    The engine owns the counts (switches, the switch-time histogram), so they are exported as
    they are, not re-accumulated here; a restarted replica starts from zero like any counter.
    """

    def __init__(self) -> None:
        self.states: dict[str, BatchingState] = {}

    def update(self, replica: str, state: BatchingState | None) -> None:
        if state is None:
            self.states.pop(replica, None)
        else:
            self.states[replica] = state

    def describe(self):
        return []  # families depend on the replicas seen; nothing to pre-register

    def collect(self):
        mode = GaugeMetricFamily(
            "dlora_batching_mode", "Weights of the replica: 0 unmerged, 1 one adapter merged", labels=["replica"]
        )
        merged = GaugeMetricFamily(
            "dlora_merged_adapter", "1 for the adapter merged into the replica's weights", labels=["replica", "adapter"]
        )
        weights = GaugeMetricFamily(
            "dlora_weight_state",
            "1 for the replica's weight state (unmerged, merged, unknown, restoring), 0 for the others",
            labels=["replica", "state"],
        )
        restores = CounterMetricFamily(
            "dlora_weight_restores",
            "Times the replica's weights were unknown (a switch unconfirmed) and restored to the base",
            labels=["replica"],
        )
        switches = CounterMetricFamily("dlora_switches", "Merges and unmerges applied", labels=["replica"])
        failures = CounterMetricFamily(
            "dlora_merge_failures", "Merges that failed (the replica stayed unmerged)", labels=["replica"]
        )
        drains = CounterMetricFamily(
            "dlora_lora_slot_drains",
            "Adapters held back so that a request waiting for a LoRA batch slot (max_loras) got one",
            labels=["replica"],
        )
        preemptions = CounterMetricFamily(
            "dlora_preemptions",
            "Running requests the engine preempted because its KV cache was full (each is recomputed when resumed)",
            labels=["replica"],
        )
        seconds = HistogramMetricFamily(
            "dlora_switch_seconds", "Time to merge or unmerge one adapter", labels=["replica", "op"]
        )
        credit = GaugeMetricFamily(
            "dlora_adapter_credit",
            'Credit of an adapter in the dlora policy (seconds; adapter "" is the base model)',
            labels=["replica", "adapter"],
        )
        threshold = GaugeMetricFamily(
            "dlora_batching_threshold", "The dlora policy's switching thresholds", labels=["replica", "threshold"]
        )
        fairness = GaugeMetricFamily(
            "dlora_kv_fairness_gap",
            "MuxServe's max |R_a - R_b| over adapters at the last step, R = KV blocks used / request rate",
            labels=["replica"],
        )
        for rid, st in sorted(self.states.items()):
            if st.kv_fairness_gap is not None:
                fairness.add_metric([rid], st.kv_fairness_gap)
            mode.add_metric([rid], 1 if st.mode == "merged" else 0)
            if st.merged_adapter is not None:
                merged.add_metric([rid, st.merged_adapter], 1)
            for state in WEIGHT_STATES:
                weights.add_metric([rid, state], 1 if st.weights == state else 0)
            restores.add_metric([rid], st.weight_restores)
            switches.add_metric([rid], st.num_switches)
            failures.add_metric([rid], st.merge_failures)
            drains.add_metric([rid], st.lora_slot_drains)
            preemptions.add_metric([rid], st.preemptions)
            for op, t in sorted(st.switch_times.items()):
                buckets = [(str(b), float(n)) for b, n in zip(SWITCH_SECONDS_BUCKETS, t.bucket_counts)]
                seconds.add_metric([rid, op], buckets + [("+Inf", float(t.count))], t.total_seconds)
            for adapter, c in sorted(st.credits.items()):
                credit.add_metric([rid, adapter], c)
            for name, value in (("alpha", st.alpha), ("beta", st.beta)):
                if value is not None:
                    threshold.add_metric([rid, name], value)
        yield from (mode, merged, weights, restores, switches, failures, drains, preemptions, seconds, credit)
        yield from (threshold, fairness)


class ClusterCollector:
    """The router's own counters, rendered at scrape time (the router is the source of truth)."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.restarts: dict[str, int] = {}

    def describe(self):
        return []

    def collect(self):
        resub = CounterMetricFamily(
            "dlora_request_resubmissions", "Requests resubmitted to another replica after a replica failure"
        )
        resub.add_metric([], self.counters.get("resubmissions", 0))
        moved = CounterMetricFamily("dlora_migrations", "Running requests moved between replicas (abort + resubmit)")
        moved.add_metric([], self.counters.get("migrations", 0))
        restarts = CounterMetricFamily("dlora_replica_restarts", "Times a replica was rebuilt", labels=["replica"])
        for rid, n in sorted(self.restarts.items()):
            restarts.add_metric([rid], n)
        gave_up = CounterMetricFamily(
            "dlora_request_resubmission_limit",
            "Requests failed because their replicas failed more than cluster.max_resubmissions times",
        )
        gave_up.add_metric([], self.counters.get("resubmission_limit", 0))
        infeasible = CounterMetricFamily(
            "dlora_dispatch_slo_infeasible",
            "Requests dispatched (cluster.dispatch slo_feasible or best_fit) when no replica could keep every "
            "request's SLO: sent to the least pending time",
        )
        infeasible.add_metric([], self.counters.get("slo_infeasible_dispatches", 0))
        busy = CounterMetricFamily(
            "dlora_replica_busy_deadlines",
            "Replica calls that missed cluster.actor_call_timeout_s while the replica answered pings "
            "(a long engine step): waited for, not counted as failures",
        )
        busy.add_metric([], self.counters.get("busy_deadlines", 0))
        # How fresh the replica gauges are: a scraper that waits for this to grow past its value at
        # time t reads gauges from after t (they are what the balancer's loop last read).
        reads = CounterMetricFamily(
            "dlora_replica_stats_reads", "Rounds of replica stats the balancer's loop has read (what the gauges show)"
        )
        reads.add_metric([], self.counters.get("stats_reads", 0))
        yield from (resub, moved, restarts, gave_up, infeasible, busy, reads)


class SloCollector:
    """Per-adapter SLO attainment and SeaLLM's normalized latency, as the router's accounting
    (`dlora.slo.accounting`) holds them at the scrape.

    Rendered from that state rather than kept in labelled children, so an adapter's series exist
    only while it is registered (unregistering it drops its counts, and its series with them), and
    the `adapter` label takes no more values than the other per-adapter metrics: registered adapters
    and "" for the base model.
    """

    def __init__(self) -> None:
        self.counts: dict[str, AdapterCounts] = {}

    def update(self, counts: dict[AdapterName, AdapterCounts]) -> None:
        self.counts = {adapter or "": c for adapter, c in counts.items()}

    def describe(self):
        return []

    def collect(self):
        requests = CounterMetricFamily(
            "dlora_slo_requests",
            "Finished requests whose TTFT and TPOT both met their adapter's SLO (outcome=met) or not (missed)",
            labels=["adapter", "outcome"],
        )
        attainment = GaugeMetricFamily(
            "dlora_slo_attainment", "Share of the adapter's finished requests that met its SLO", labels=["adapter"]
        )
        normalized = GaugeMetricFamily(
            "dlora_slo_normalized_latency",
            "Mean latency of the adapter's finished requests over their average isolated execution time "
            "(SeaLLM's normalized latency; 1 = as fast as alone)",
            labels=["adapter"],
        )
        for adapter, c in sorted(self.counts.items()):
            requests.add_metric([adapter, "met"], c.attained)
            requests.add_metric([adapter, "missed"], c.requests - c.attained)
            if c.attainment is not None:
                attainment.add_metric([adapter], c.attainment)
            if c.mean_normalized_latency is not None:
                normalized.add_metric([adapter], c.mean_normalized_latency)
        yield from (requests, attainment, normalized)

"""Prometheus metrics, all in one place, labelled by adapter ("" is the base model) or replica."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dlora_requests", "Finished requests", ["adapter", "status"], registry=r)
        self.prompt_tokens = Counter("dlora_prompt_tokens", "Prompt tokens processed", ["adapter"], registry=r)
        self.generation_tokens = Counter("dlora_generation_tokens", "Tokens generated", ["adapter"], registry=r)
        self.ttft = Histogram("dlora_time_to_first_token_seconds", "Time to first token", ["adapter"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dlora_time_per_output_token_seconds", "Mean time per output token after the first",
                              ["adapter"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("dlora_e2e_request_latency_seconds", "End-to-end request latency", ["adapter"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("dlora_requests_running", "Requests that have produced a token", ["adapter"], registry=r)
        self.waiting = Gauge("dlora_requests_waiting", "Requests waiting for their first token", ["adapter"],
                             registry=r)
        self.adapters_registered = Gauge("dlora_adapters_registered", "Registered adapters", registry=r)
        self.adapters_resident = Gauge("dlora_adapters_resident", "Adapters loaded in a replica's engine",
                                       ["replica"], registry=r)
        self.replica_healthy = Gauge("dlora_replica_healthy", "1 when the replica serves", ["replica"], registry=r)
        self.replica_unfinished = Gauge("dlora_replica_unfinished_requests", "Requests inside the engine",
                                        ["replica"], registry=r)
        self.resubmissions = Counter("dlora_request_resubmissions", "Requests resubmitted after a replica failure",
                                     registry=r)

    def track(self, adapter: str, prompt_tokens: int) -> "RequestTracker":
        self.prompt_tokens.labels(adapter).inc(prompt_tokens)
        self.waiting.labels(adapter).inc()
        return RequestTracker(self, adapter)

    def render(self) -> bytes:
        return generate_latest(self.registry)


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

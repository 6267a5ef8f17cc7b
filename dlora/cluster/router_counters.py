"""What the router counts and learns as requests pass: event counters, arrivals and finished work
(the autoscaler's heartbeat differences the totals), each replica's fitted step costs, the output
lengths of finished requests, and their SLO attainment."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable

from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.estimators.replica_cost import CostParams, ReplicaCostModel
from dlora.cluster.policy_views import IterationSample
from dlora.cluster.request_state import RequestState
from dlora.cluster.router_config import RouterConfig
from dlora.replica.messages import Delta, GenerateRequest
from dlora.slo.accounting import SloAccounting
from dlora.slo.isolated import mean_params


class RouterCounters:
    def __init__(self, cfg: RouterConfig, replica_ids: Iterable[int], clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.clock = clock
        self.counters: Counter[str] = Counter()  # resubmissions, migrations, ...
        self.arrivals: deque[tuple[float, str | None]] = deque(maxlen=100_000)  # (time, adapter) for rates
        self.arrivals_total = 0  # requests that ever arrived (the balancer's period rates)
        # Output tokens streamed, and requests (and their tokens) that finished by themselves or at
        # their cap, since start: the autoscaler's heartbeat differences them.
        self.output_tokens_total = 0
        self.finished_total = 0
        self.finished_tokens_total = 0
        # Fitted from each replica's measured steps (refresh_stats); kept across restarts (same hardware).
        self.cost_models = {
            rid: ReplicaCostModel(CostParams(max_batch=cfg.max_batch, merged_ratio=cfg.merged_ratio_prior))
            for rid in replica_ids
        }
        # Lengths of finished requests per adapter: what dispatch and migration expect instead of max_tokens.
        self.output_lengths = OutputLengthEstimator(cfg.output_lengths)
        # Per-adapter SLO attainment and normalized latency of finished requests (for /metrics); the
        # adapter life cycle sets each adapter's own SLO and drops an unregistered one.
        self.slo = SloAccounting(cfg.slo, self.isolated_basis())
        # (replica id, adapter or "" for the base model) -> [prompt tokens sent, of them found in the
        # replica's prefix cache], per leg as the engine reports it (/metrics)
        self.prefix_cache: dict[tuple[int, str], list[int]] = {}

    def prefix_cache_read(self, replica_id: int, state: RequestState, leg: GenerateRequest, cached_tokens: int) -> None:
        """A leg's first output: how much of its prompt the replica found in its prefix cache."""
        tokens = self.prefix_cache.setdefault((replica_id, state.adapter or ""), [0, 0])
        tokens[0] += len(leg.prompt_token_ids)
        tokens[1] += cached_tokens

    def arrived(self, state: RequestState) -> None:
        self.arrivals.append((state.arrival, state.adapter))
        self.arrivals_total += 1

    def finished(self, state: RequestState, delta: Delta) -> None:
        """Feed the output-length history and the SLO accounting: a request that ended by itself
        ("stop") or at its cap ("length", a lower bound of its length); aborted ones say nothing
        about their length, and their latency is not the service's."""
        if delta.finish_reason not in ("stop", "length"):
            return
        self.finished_total += 1
        self.finished_tokens_total += len(state.generated)
        self.output_lengths.observe(state.adapter, len(state.generated), ended=delta.finish_reason == "stop")
        if state.first_token_at is not None:
            self.slo.record(
                state.adapter,
                prompt_tokens=len(state.request.prompt_token_ids),
                ttft_s=state.first_token_at - state.arrival,
                latency_s=self.clock() - state.arrival,
                output_tokens=len(state.generated),
            )

    def adapter_rates(self, window_s: float) -> dict[str, float]:
        """Requests per second per adapter over the last `window_s` seconds."""
        since = self.clock() - window_s
        counts = Counter(a for t, a in self.arrivals if t >= since and a is not None)
        return {a: n / window_s for a, n in counts.items()}

    def cost_params(self) -> dict[int, CostParams]:
        return {rid: model.params for rid, model in self.cost_models.items()}

    def isolated_basis(self) -> CostParams:
        """What a request's isolated times are priced with: the replicas' fitted coefficients, averaged."""
        return mean_params(list(self.cost_params().values()))

    def new_replica(self, replica_id: int) -> None:
        """A replica joins: its cost model starts from the others' fitted ones (same hardware)."""
        self.cost_models[replica_id] = ReplicaCostModel(self.isolated_basis())

    def observe_iterations(self, replica_id: int, iterations) -> None:
        self.cost_models[replica_id].observe(*(IterationSample(*step) for step in iterations))

    def observe_load(self, replica_id: int, seconds: float) -> None:
        self.cost_models[replica_id].observe_load(seconds)

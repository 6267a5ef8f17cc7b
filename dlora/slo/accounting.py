"""Per-adapter SLO accounting of finished requests: which SLO each is held to, and whether it met it.

The router records every request that finished by itself ("stop" or "length") with its measured
times; `dlora bench` feeds the same class its client-side measurements, so a server's /metrics and
a benchmark's report judge requests by one rule. Per request:

- its isolated times follow from the prompt length and the cluster's step-time coefficients
  (`basis`, `dlora.slo.isolated`);
- its SLO is its adapter's own (`set_target`), else the configured default, absolute or
  `relative_k` x its isolated times (`SloConfig.slo_for`);
- it attains the SLO when TTFT and TPOT both hold, and adds latency / isolated execution time to
  its adapter's normalized latency (`dlora.slo.attainment`).

Each request costs O(1); each adapter keeps one target and one set of sums, both dropped when the
adapter is unregistered (`forget`), so memory grows with the adapters registered, not the requests.
A request that produced no token has no TTFT and is not counted.
"""

from __future__ import annotations

from dlora.cost.params import CostParams
from dlora.slo.attainment import AdapterCounts, AdapterName, AttainmentCounter
from dlora.slo.config import AdapterSlo, SloConfig
from dlora.slo.isolated import isolated_times


class SloAccounting:
    def __init__(self, cfg: SloConfig | None = None, basis: CostParams | None = None) -> None:
        self.cfg = cfg or SloConfig()
        # The step-time coefficients isolated times are computed from (`dlora.slo.isolated.mean_params`
        # of the replicas' fitted cost models, refreshed as they are refitted).
        self.basis = basis or CostParams()
        self._targets: dict[str, AdapterSlo] = {}  # adapters with an SLO of their own
        self._counter = AttainmentCounter()

    def set_target(self, adapter: str, slo: AdapterSlo | None) -> None:
        """The adapter's own SLO; None: it is held to the default."""
        if slo is None:
            self._targets.pop(adapter, None)
        else:
            self._targets[adapter] = slo

    def target(self, adapter: AdapterName) -> AdapterSlo | None:
        """The adapter's own SLO, None when it has none (the base model never has one)."""
        return None if adapter is None else self._targets.get(adapter)

    def slo_of(self, adapter: AdapterName, prompt_tokens: int) -> AdapterSlo:
        """The SLO a request of `adapter` with `prompt_tokens` is held to (as `record` judges it)."""
        return self.cfg.slo_for(self.target(adapter), isolated_times(self.basis, prompt_tokens))

    def forget(self, adapter: str) -> None:
        """The adapter was unregistered: drop its target and its counts."""
        self._targets.pop(adapter, None)
        self._counter.forget(adapter)

    def record(
        self, adapter: AdapterName, *, prompt_tokens: int, ttft_s: float, latency_s: float, output_tokens: int
    ) -> bool:
        """Count one finished request (seconds from its arrival to its first and last token);
        returns whether it attained its SLO."""
        iso = isolated_times(self.basis, prompt_tokens)
        return self._counter.record(
            adapter,
            ttft_s=ttft_s,
            latency_s=latency_s,
            output_tokens=output_tokens,
            isolated_s=iso.execution_s(output_tokens),
            slo=self.slo_of(adapter, prompt_tokens),
        )

    def counts(self) -> dict[AdapterName, AdapterCounts]:
        """Every counted adapter's sums (copies)."""
        return {a: self._counter.counts(a) for a in self._counter.adapters()}

    def attainment(self) -> float | None:
        """Share of every counted request that attained its SLO; None before any."""
        return self._counter.attainment()

    def mean_normalized_latency(self) -> float | None:
        """SeaLLM's normalized latency per request over every adapter; None before any request."""
        return self._counter.mean_normalized_latency()

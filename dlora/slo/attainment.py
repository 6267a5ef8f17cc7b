"""SLO attainment and SeaLLM's normalized latency, per adapter: pure accumulators, no clock.

Attainment (Aladdin §6.1, SeaLLM §6.1): a finished request attains its SLO only if both its TTFT
and its average time per output token (Aladdin's ATGT, decode time / (output tokens - 1)) are
within its adapter's targets. A target met exactly counts as met (Aladdin: "must not exceed").
A one-token reply has no decode phase, so only its TTFT is judged.

Normalized latency (SeaLLM Eq. 1):

    L_N = sum over adapters a, over requests r of a:  L_r / L̂_a

L_r is the request's end-to-end latency and L̂_a the *average* isolated execution time of the
adapter's requests (SeaLLM: "the average request execution time of service s"), not the request's
own isolated time: SeaLLM's evaluation reports "the average of end-to-end latency divided by the
average execution time"; its optimality proof (Appendix A.2) weighs every request of a service by
the same 1/L̂_s, which is also what the doubling-budget order (`dlora.slo.priority`) minimizes.
So the counters keep, per adapter, the sum of latencies and the sum of isolated times of the same
requests, and L̂_a is their ratio's denominator: L_N^a = sum(L_r) / (sum(L_iso) / n).
Note the name clash: vLLM and dLoRA call latency per output token "normalized latency"; this is
SeaLLM's (latency relative to isolated execution).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from dlora.slo.config import AdapterSlo

AdapterName = str | None  # an adapter name, or None for the base model


def tpot_s(ttft_s: float, latency_s: float, output_tokens: int) -> float | None:
    """Aladdin's ATGT: the decode time spread over the tokens after the first; None with fewer than
    two output tokens (no decode phase)."""
    if output_tokens < 2:
        return None
    return max(0.0, latency_s - ttft_s) / (output_tokens - 1)


def ttft_met(ttft_s: float, slo: AdapterSlo) -> bool:
    return ttft_s <= slo.ttft_s


def tpot_met(tpot: float | None, slo: AdapterSlo) -> bool:
    """None (a one-token reply) has no decode phase to miss."""
    return tpot is None or tpot <= slo.tpot_s


def attained(ttft_s: float, tpot: float | None, slo: AdapterSlo) -> bool:
    """Both targets met (Aladdin §6.1: "the SLO is attained when both TTFT and ATGT ... meet the requirement")."""
    return ttft_met(ttft_s, slo) and tpot_met(tpot, slo)


def normalized_latency(latency_s: float, adapter_isolated_s: float) -> float:
    """One request's term of SeaLLM Eq. 1: its latency over its adapter's average isolated
    execution time L̂_a (seconds / seconds)."""
    if adapter_isolated_s <= 0:
        raise ValueError(f"adapter isolated execution time {adapter_isolated_s!r}: must be > 0")
    return latency_s / adapter_isolated_s


@dataclass(slots=True)
class AdapterCounts:
    """One adapter's finished requests, summed."""

    requests: int = 0
    attained: int = 0
    ttft_met: int = 0
    tpot_met: int = 0
    latency_sum_s: float = 0.0  # sum of end-to-end latencies L_r
    isolated_sum_s: float = 0.0  # sum of the same requests' isolated execution times

    @property
    def attainment(self) -> float | None:
        """Fraction of requests that met both targets; None before any finished."""
        return self.attained / self.requests if self.requests else None

    @property
    def mean_isolated_s(self) -> float | None:
        """L̂_a: the adapter's average isolated execution time over the recorded requests."""
        return self.isolated_sum_s / self.requests if self.requests else None

    @property
    def normalized_latency(self) -> float | None:
        """L_N^a = sum(L_r) / L̂_a, the adapter's part of SeaLLM Eq. 1 (a sum over its requests)."""
        mean_iso = self.mean_isolated_s
        if mean_iso is None or mean_iso <= 0:
            return None
        return self.latency_sum_s / mean_iso

    @property
    def mean_normalized_latency(self) -> float | None:
        """L_N^a per request: how many times its average isolated execution time the adapter's
        requests took, on average (1 = as fast as alone)."""
        total = self.normalized_latency
        return None if total is None else total / self.requests


class AttainmentCounter:
    """Per-adapter attainment and normalized latency, fed one finished request at a time."""

    def __init__(self) -> None:
        self._by_adapter: dict[AdapterName, AdapterCounts] = {}

    def record(
        self,
        adapter: AdapterName,
        *,
        ttft_s: float,
        latency_s: float,
        output_tokens: int,
        isolated_s: float,
        slo: AdapterSlo,
    ) -> bool:
        """Count one finished request (times in seconds, `isolated_s` its isolated execution time,
        `slo` the targets it was held to); returns whether it attained its SLO."""
        tpot = tpot_s(ttft_s, latency_s, output_tokens)
        ok_ttft, ok_tpot = ttft_met(ttft_s, slo), tpot_met(tpot, slo)
        c = self._by_adapter.setdefault(adapter, AdapterCounts())
        c.requests += 1
        c.ttft_met += ok_ttft
        c.tpot_met += ok_tpot
        c.attained += ok_ttft and ok_tpot
        c.latency_sum_s += latency_s
        c.isolated_sum_s += isolated_s
        return ok_ttft and ok_tpot

    def adapters(self) -> list[AdapterName]:
        return list(self._by_adapter)

    def forget(self, adapter: AdapterName) -> None:
        """Drop the adapter's counts (it was unregistered: nothing of it is served or reported)."""
        self._by_adapter.pop(adapter, None)

    def counts(self, adapter: AdapterName) -> AdapterCounts:
        """A copy of the adapter's counts (zeros if it has none)."""
        c = self._by_adapter.get(adapter)
        return AdapterCounts() if c is None else dataclasses.replace(c)

    def attainment(self, adapters: Iterable[AdapterName] | None = None) -> float | None:
        """Fraction of all requests (of `adapters`, default every adapter) that attained their SLO."""
        chosen = [self.counts(a) for a in (self._by_adapter if adapters is None else adapters)]
        total = sum(c.requests for c in chosen)
        return sum(c.attained for c in chosen) / total if total else None

    def normalized_latency_sum(self) -> float:
        """SeaLLM Eq. 1: L_N summed over every adapter's requests."""
        return sum(c.normalized_latency or 0.0 for c in self._by_adapter.values())

    def mean_normalized_latency(self) -> float | None:
        """L_N per request: what SeaLLM's evaluation plots as "normalized latency"."""
        total = sum(c.requests for c in self._by_adapter.values())
        return self.normalized_latency_sum() / total if total else None

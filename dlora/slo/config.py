"""Configuration of SLO-aware serving (`slo:`) and the per-adapter SLO a load request may carry.

An adapter's SLO has two targets, both of which a request must meet to count as attained
(Aladdin §6.1):

- `ttft_s`: time to first token, in seconds (Aladdin's prefill SLO T_pre);
- `tpot_s`: average time per output token after the first, in seconds (Aladdin's ATGT SLO T_dec,
  §2.2: decode time / (output tokens - 1)).

An adapter loaded without one gets the server's default: absolute (`slo.ttft_s`, `slo.tpot_s`,
like Aladdin's Table 2), or SeaLLM's relative default when those are unset: `relative_k` (5 in
SeaLLM's evaluation) times the request's isolated times (`dlora.slo.isolated`). SeaLLM's SLO is on
end-to-end latency, L_r <= k * L_iso; scaling both the isolated TTFT and TPOT by k keeps that
bound, since L_r = TTFT + (n - 1) * TPOT <= k * (TTFT_iso + (n - 1) * TPOT_iso) = k * L_iso, and
yields the two targets dispatch and attainment use.

Which policies run: `order` (fcfs: dLoRA's arrival order; seallm: the doubling-budget priority of
`dlora.slo.priority`), `dispatch` (least_pending: dLoRA's proactive dispatch; slo_feasible and
best_fit: `dlora.cluster.feasible_dispatch`), `kv_quotas` (MuxServe's per-adapter KV quotas,
`dlora.slo.kv_shares`), and the re-optimisation period (SeaLLM Eq. 8, `dlora.slo.reopt_period`).

A bad value raises ValueError naming the key (`slo.<name>`) and the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dlora.kinds import kind_error
from dlora.slo.isolated import IsolatedTimes

ORDERS = ("fcfs", "seallm")
DISPATCHES = ("least_pending", "slo_feasible", "best_fit")
# The least relative target: a cost model fitted to zero must not yield a target of zero seconds.
MIN_RELATIVE_SLO_S = 1e-3


def _require(cond: bool, name: str, value: object, why: str) -> None:
    if not cond:
        raise ValueError(f"slo.{name}={value!r}: {why}")


def _positive_seconds(name: str, value: object) -> None:
    """A finite number of seconds > 0 (not a bool, not NaN or infinity)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and float(value) > 0
    _require(ok, name, value, "must be a finite number of seconds > 0")


@dataclass(frozen=True, slots=True)
class AdapterSlo:
    """One adapter's targets: TTFT and average time per output token, in seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        _positive_seconds("ttft_s", self.ttft_s)
        _positive_seconds("tpot_s", self.tpot_s)


def parse_adapter_slo(data: object) -> AdapterSlo | None:
    """The `"slo": {"ttft_s": .., "tpot_s": ..}` of an adapter load body; None when absent (the
    adapter then gets `SloConfig.slo_for`'s default). Both keys are required; another key, a value
    that is not a number, or one that is NaN, infinite or <= 0 raises ValueError naming it."""
    if data is None:
        return None
    if isinstance(data, AdapterSlo):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"slo={data!r}: must be an object with ttft_s and tpot_s (seconds)")
    allowed = [f.name for f in fields(AdapterSlo)]
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ValueError(f"slo.{unknown[0]}: unknown key (allowed: {', '.join(allowed)})")
    for key in allowed:
        if key not in data:
            raise ValueError(f"slo.{key}: missing (an SLO needs both {' and '.join(allowed)})")
    return AdapterSlo(ttft_s=data["ttft_s"], tpot_s=data["tpot_s"])


@dataclass(frozen=True)
class SloConfig:
    # Default SLO of an adapter loaded without one. Both set: absolute targets in seconds. Both
    # unset (null): SeaLLM's relative default, relative_k x the request's isolated TTFT and TPOT.
    ttft_s: float | None = None
    tpot_s: float | None = None
    relative_k: float = 5.0  # SeaLLM §6.1: SLO = 5x the execution time
    # Order of a replica's requests: fcfs (dLoRA) | seallm (doubling-budget priority, SeaLLM §4.2).
    order: str = "fcfs"
    # Replica choice: least_pending (dLoRA §5.1) | slo_feasible (least pending time among replicas
    # meeting Aladdin's constraints) | best_fit (the feasible replica with the least slack).
    dispatch: str = "least_pending"
    # Aladdin §4.2: gamma, the share of a request's predicted output its decode bound counts
    # (0: only the first decode step must meet the TPOT target, 1: the last one too; the paper
    # uses 0.5); theta in (0, 1], the margin for output-length prediction error (the paper gives
    # no value; smaller is safer and packs fewer requests per replica).
    gamma: float = 0.5
    theta: float = 0.9
    # MuxServe ADBS: per-adapter KV block quotas in proportion to request rates, re-adapted every
    # quota_period_s (the rates are measured over that period).
    kv_quotas: bool = False
    quota_period_s: float = 10.0
    # SeaLLM Eq. 8: the re-optimisation period starts at reopt_initial_s and shrinks by (1 - beta)
    # or grows by (1 + beta) after each period, kept within [reopt_min_s, reopt_max_s].
    reopt_beta: float = 0.1
    reopt_initial_s: float = 30.0
    reopt_min_s: float = 5.0
    reopt_max_s: float = 600.0

    def __post_init__(self) -> None:
        why = kind_error(self, "slo")
        if why:
            raise ValueError(why)
        _require(
            (self.ttft_s is None) == (self.tpot_s is None),
            "ttft_s" if self.ttft_s is None else "tpot_s",
            None,
            "set both slo.ttft_s and slo.tpot_s (absolute default) or neither (relative default)",
        )
        for name in ("ttft_s", "tpot_s"):
            if getattr(self, name) is not None:
                _positive_seconds(name, getattr(self, name))
        _require(
            math.isfinite(self.relative_k) and self.relative_k >= 1,
            "relative_k",
            self.relative_k,
            "must be a finite number >= 1 (an SLO tighter than the isolated time is never met)",
        )
        _require(self.order in ORDERS, "order", self.order, f"must be one of {', '.join(ORDERS)}")
        _require(self.dispatch in DISPATCHES, "dispatch", self.dispatch, f"must be one of {', '.join(DISPATCHES)}")
        _require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        _require(0 < self.theta <= 1, "theta", self.theta, "must be in (0, 1]")
        _positive_seconds("quota_period_s", self.quota_period_s)
        _require(0 < self.reopt_beta < 1, "reopt_beta", self.reopt_beta, "must be in (0, 1)")
        for name in ("reopt_min_s", "reopt_initial_s", "reopt_max_s"):
            _positive_seconds(name, getattr(self, name))
        _require(
            self.reopt_min_s <= self.reopt_initial_s <= self.reopt_max_s,
            "reopt_initial_s",
            self.reopt_initial_s,
            f"must lie within [slo.reopt_min_s, slo.reopt_max_s] = [{self.reopt_min_s}, {self.reopt_max_s}]",
        )

    @property
    def relative(self) -> bool:
        """Whether the default SLO is SeaLLM's relative one (no absolute targets set)."""
        return self.ttft_s is None

    def slo_for(self, explicit: AdapterSlo | None, isolated: IsolatedTimes) -> AdapterSlo:
        """The SLO a request is held to: its adapter's own, else the absolute default, else
        relative_k x its isolated times (`dlora.slo.isolated.isolated_times`), at least
        MIN_RELATIVE_SLO_S each."""
        if explicit is not None:
            return explicit
        if self.ttft_s is not None and self.tpot_s is not None:
            return AdapterSlo(self.ttft_s, self.tpot_s)
        k, floor = self.relative_k, MIN_RELATIVE_SLO_S
        return AdapterSlo(max(floor, k * isolated.ttft_s), max(floor, k * isolated.tpot_s))


def from_dict(data: Mapping[str, Any]) -> SloConfig:
    """`SloConfig` from a YAML/JSON mapping; an unknown key raises ValueError naming it."""
    known = {f.name for f in fields(SloConfig)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ValueError(f"slo.{unknown[0]}: unknown key")
    return SloConfig(**data)

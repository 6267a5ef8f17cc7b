"""`slo:` = the default latency targets requests are judged against (dlora.slo.config holds the
policy itself)."""

from __future__ import annotations

from dataclasses import dataclass

from dlora.config.checks import as_config_error, check_kinds
from dlora.slo.config import SloConfig


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
        check_kinds(self, "slo")
        as_config_error(self.policy)

    def policy(self) -> SloConfig:
        """The SLO policy's own config (`dlora.slo.config.SloConfig`, which checks these values)."""
        return SloConfig(ttft_s=self.ttft_s, tpot_s=self.tpot_s, relative_k=self.relative_k)

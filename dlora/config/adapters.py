"""`adapters:` = the adapters registered at start, each with its own optional latency targets."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dlora.config.checks import ConfigError, check_kinds
from dlora.slo.config import AdapterSlo, parse_adapter_slo

# What an adapter's name may hold, wherever it is given (config, the load route, a resolver): never
# "@", which separates the name from the version in the name an engine knows an adapter by
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9._:/-]+$"


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    pinned: bool = False
    # Its own latency targets, {ttft_s, tpot_s} in YAML; null: the `slo:` default applies.
    slo: AdapterSlo | None = None

    def __post_init__(self) -> None:
        check_kinds(self, "adapters")
        if not re.fullmatch(ADAPTER_NAME_PATTERN, self.name):
            raise ConfigError(f"adapters: name {self.name!r} may hold only letters, digits and . _ : / -")
        try:
            # YAML gives a mapping; parse_adapter_slo checks it and names the bad key (slo.<key>).
            object.__setattr__(self, "slo", parse_adapter_slo(self.slo))
        except ValueError as e:
            raise ConfigError(f"adapters.{e} (adapter {self.name!r})") from None

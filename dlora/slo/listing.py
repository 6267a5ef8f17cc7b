"""SLOs as `GET /v1/adapters` shows them, and read back by a client (`dlora bench`).

Each adapter entry carries `"slo": {"ttft_s", "tpot_s", "relative_k", "source"}`:

- `source: "adapter"`: its own targets (the load request's or the config's `slo`);
- `source: "default"`: the server's absolute default (`slo.ttft_s`, `slo.tpot_s`);
- `source: "relative"`: SeaLLM's relative default, `relative_k` x each request's isolated times
  (`ttft_s` and `tpot_s` are null: they depend on the request's prompt length).

The list itself carries `slo_default` (the same shape: what the base model and adapters without
their own are held to) and `isolated`, the step-time coefficients isolated times are computed from
(`dlora.slo.isolated`). With these a client judges its own measurements exactly as the server does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlora.cost.params import CostParams
from dlora.slo.accounting import SloAccounting
from dlora.slo.config import AdapterSlo, SloConfig
from dlora.slo.isolated import ISOLATED_COEFFICIENTS


def slo_json(own: AdapterSlo | None, cfg: SloConfig) -> dict[str, Any]:
    """An adapter's `slo` entry: its own targets, else the default in force."""
    if own is not None:
        return {"ttft_s": own.ttft_s, "tpot_s": own.tpot_s, "relative_k": None, "source": "adapter"}
    if cfg.relative:
        return {"ttft_s": None, "tpot_s": None, "relative_k": cfg.relative_k, "source": "relative"}
    return {"ttft_s": cfg.ttft_s, "tpot_s": cfg.tpot_s, "relative_k": None, "source": "default"}


def listing_json(accounting: SloAccounting) -> dict[str, Any]:
    """The list-level fields: the default SLO and the isolated-time coefficients."""
    return {
        "slo_default": slo_json(None, accounting.cfg),
        "isolated": {name: getattr(accounting.basis, name) for name in ISOLATED_COEFFICIENTS},
    }


def accounting_from_listing(listing: Mapping[str, Any]) -> SloAccounting:
    """An empty `SloAccounting` holding the listed SLOs and coefficients, to judge requests measured
    elsewhere; ValueError when the listing has none (a server without SLOs: not dlora, or older)."""
    try:
        default = listing["slo_default"]
        cfg = SloConfig(
            ttft_s=default["ttft_s"],
            tpot_s=default["tpot_s"],
            relative_k=default["relative_k"] or SloConfig.relative_k,
        )
        basis = CostParams(**{name: listing["isolated"][name] for name in ISOLATED_COEFFICIENTS})
        accounting = SloAccounting(cfg, basis)
        for entry in listing["data"]:
            slo = entry["slo"]
            if slo["source"] == "adapter":
                accounting.set_target(entry["name"], AdapterSlo(slo["ttft_s"], slo["tpot_s"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the adapter list carries no SLOs ({type(e).__name__}: {e})") from None
    return accounting

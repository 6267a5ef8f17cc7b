"""Per-adapter SLO attainment and SeaLLM's normalized latency, from the benchmark's own measurements.

The targets are the server's: dlora's `GET /v1/adapters` lists each adapter's SLO, the default, and
the coefficients isolated times are computed from (docs/api.md, SLOs). It is read once the requests
have finished, so the coefficients are the ones fitted from the run's own steps. Every successful
request is then judged with `dlora.slo.accounting`, the rule the server's /metrics uses, but on the
client's clock: TTFT and latency from sending the request, prompt length as the server counted it
(`usage`), else as the workload estimated it.

- `slo_attainment`: requests that met both targets over all requests sent (a failed request is a
  miss, as in the dLoRA per-token attainment of `report.py`);
- `slo_attainment_coldest_adapter`: the same over the least-requested adapter's requests (the one
  a skewed workload starves first; ties go to the first name), `coldest_adapter` naming it;
- `normalized_latency`: SeaLLM's, mean over successful requests of latency / the adapter's average
  isolated execution time (1 = as fast as alone).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from dlora.bench.client import RequestResult
from dlora.slo.accounting import SloAccounting
from dlora.slo.attainment import AdapterName
from dlora.slo.listing import accounting_from_listing, slo_json


def adapter_slo_report(
    results: Sequence[RequestResult], adapter_list: Mapping[str, Any], base_model: str | None
) -> dict[str, Any]:
    """The report of `results` against the SLOs of `adapter_list` (GET /v1/adapters as sent); each
    result's `adapter` is its adapter's name, or `base_model` for the base model. ValueError when
    the list carries no SLOs."""
    accounting = accounting_from_listing(adapter_list)
    for r in results:
        if r.success:
            accounting.record(
                r.adapter, prompt_tokens=r.prompt_len, ttft_s=r.ttft, latency_s=r.latency, output_tokens=r.output_tokens
            )
    return slo_summary(accounting, Counter(r.adapter for r in results), base_model)


def slo_summary(accounting: SloAccounting, sent: Mapping[AdapterName, int], base_model: str | None) -> dict[str, Any]:
    """The report's fields from the requests `accounting` judged, out of `sent` requests per adapter
    (one sent but never judged, having failed, counts as a miss); `base_model` names the base
    model's requests, which no adapter's coldness counts."""
    counts = accounting.counts()
    per_adapter: dict[str, dict[str, Any]] = {}
    for name in sorted(sent, key=str):
        c = counts.get(name)
        attained = c.attained if c else 0
        per_adapter[str(name)] = {
            "requests": sent[name],
            "completed": c.requests if c else 0,
            "attained": attained,
            "slo_attainment": attained / sent[name],
            "normalized_latency": c.mean_normalized_latency if c else None,
            "slo": slo_json(accounting.target(name), accounting.cfg),
        }
    adapters = [name for name in sent if name is not None and name != base_model]
    coldest = min(adapters, key=lambda a: (sent[a], a), default=None)
    total = sum(sent.values())
    return {
        "slo_attainment": sum(m["attained"] for m in per_adapter.values()) / total if total else None,
        "slo_attainment_coldest_adapter": per_adapter[coldest]["slo_attainment"] if coldest is not None else None,
        "coldest_adapter": coldest,
        "normalized_latency": accounting.mean_normalized_latency(),
        "per_adapter": per_adapter,
    }

"""deploy/grafana/dlora-dashboard.json: every panel queries only metrics a real dlora `/metrics`
exports (the shared server over toy replicas: the real app and metrics, after one completion), on
the dashboard's `${datasource}`, and there is a panel for each thing an operator watches."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import harness

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dlora-dashboard.json"
METRIC = re.compile(r"\bdlora_[A-Za-z0-9_]+")
# The series a family of each type exports (prometheus_client names a counter's family without _total).
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}
# (topic: a word of a panel's title, a metric that panel must query)
TOPICS = [
    ("request throughput", "dlora_requests_total"),
    ("token throughput", "dlora_generation_tokens_total"),
    ("TTFT", "dlora_time_to_first_token_seconds_bucket"),
    ("TPOT", "dlora_time_per_output_token_seconds_bucket"),
    ("SLO attainment", "dlora_slo_requests_total"),
    ("batching mode", "dlora_batching_mode"),
    ("merged adapter", "dlora_merged_adapter"),
    ("weight state", "dlora_weight_state"),
    ("switches", "dlora_switches_total"),
    ("adapters resident", "dlora_adapters_resident"),
    ("host bytes", "dlora_adapter_host_bytes"),
    ("waiting requests", "dlora_requests_waiting"),
    ("queue time", "dlora_request_queue_time_seconds_bucket"),
    ("migrations", "dlora_migrations_total"),
    ("resubmissions", "dlora_request_resubmissions_total"),
    ("healthy replicas", "dlora_replica_healthy"),
    ("restarts", "dlora_replica_restarts_total"),
    ("given up", "dlora_replica_gave_up"),
    ("admission refusals", "dlora_admission_refused_total"),
    ("batches by status", "dlora_batches"),
    ("batch requests", "dlora_batch_requests_total"),
]
# Series one completion must have given samples (the panels that show a request at all).
AFTER_ONE_COMPLETION = (
    "dlora_requests_total",
    "dlora_generation_tokens_total",
    "dlora_time_to_first_token_seconds_bucket",
    "dlora_time_per_output_token_seconds_bucket",
    "dlora_slo_requests_total",
)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def metrics_of(panel: dict[str, Any]) -> set[str]:
    return {name for t in panel["targets"] for name in METRIC.findall(t["expr"])}


@pytest.fixture(scope="module")
def scraped(toy_server) -> tuple[set[str], set[str]]:
    """(every series name /metrics exports, those with samples) after one completion."""
    r = httpx.post(
        f"{toy_server.url}/v1/completions",
        json={"model": "tiny-base", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        headers={"Authorization": f"Bearer {harness.TOY_API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    exported: set[str] = set()
    sampled: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(f"{toy_server.url}/metrics", timeout=30).text):
        exported.update(family.name + suffix for suffix in SERIES_SUFFIXES.get(family.type, ("",)))
        sampled.update(s.name for s in family.samples)
    return exported | sampled, sampled


@pytest.mark.engine  # the shared `dlora serve` over toy replicas
def test_every_panel_queries_only_exported_metrics(scraped):
    exported, _ = scraped
    for panel in panels():
        assert panel["targets"], panel["title"]
        unknown = metrics_of(panel) - exported
        assert metrics_of(panel) and not unknown, f"{panel['title']!r} queries {sorted(unknown)}"


@pytest.mark.engine
def test_one_completion_shows_on_the_request_panels(scraped):
    _, sampled = scraped
    assert set(AFTER_ONE_COMPLETION) <= sampled


def test_a_panel_for_every_topic():
    by_title = {p["title"].lower(): metrics_of(p) for p in panels()}
    for topic, metric in TOPICS:
        matching = [m for title, m in by_title.items() if topic.lower() in title]
        assert any(metric in m for m in matching), f"no panel titled with {topic!r} queries {metric}"


def test_latency_panels_show_p50_and_p99():
    for p in panels():
        exprs = [t["expr"] for t in p["targets"]]
        if any("_bucket" in e for e in exprs):
            quantiles = {re.match(r"histogram_quantile\(([\d.]+),", e).group(1) for e in exprs}
            assert quantiles == {"0.5", "0.99"}, p["title"]


def test_every_panel_reads_the_datasource_variable():
    d = dashboard()
    assert d["schemaVersion"] >= 36
    (variable,) = d["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))

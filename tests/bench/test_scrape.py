"""Reading Prometheus /metrics text (dlora/bench/scrape.py), no server."""

from __future__ import annotations

import pytest

from dlora.bench.scrape import metric_by_label, metric_total, metric_values

TEXT = "\n".join(
    [
        "# HELP dlora_request_queue_time_seconds_sum x",
        'dlora_request_queue_time_seconds_sum{adapter="a0"} 1.5',
        'dlora_request_queue_time_seconds_sum{adapter=""} 0.25',
        'dlora_request_queue_time_seconds_sum{adapter="a1",replica="0"} 2.0',
        'dlora_request_queue_time_seconds_sum{replica="1",adapter="a1"} 1.0',
        'dlora_request_queue_time_seconds_count{adapter="a0"} 3.0',
        "dlora_migrations_total 7.0",
        'dlora_kv_fairness_gap{replica="0"} 12.5',
        'dlora_kv_fairness_gap{replica="1"} 3.0',
        'dlora_kv_fairness_gap_limit{replica="0"} 99.0',
    ]
)


def test_metrics_are_read_per_label_and_in_total():
    assert metric_by_label(TEXT, "dlora_request_queue_time_seconds_sum", "adapter") == {"a0": 1.5, "": 0.25, "a1": 3.0}
    assert metric_total(TEXT, "dlora_request_queue_time_seconds_sum") == pytest.approx(4.75)
    assert metric_total(TEXT, "dlora_migrations_total") == 7.0
    assert metric_total(TEXT, "dlora_absent_total") == 0.0


def test_values_are_one_per_label_set_of_that_name_only():
    # a metric whose name starts with another's is not that metric; comments are not samples
    assert metric_values(TEXT, "dlora_kv_fairness_gap") == [12.5, 3.0]
    assert metric_values(TEXT, "dlora_migrations_total") == [7.0]
    assert metric_values(TEXT, "dlora_request_queue_time_seconds_sum") == [1.5, 0.25, 2.0, 1.0]
    assert metric_values(TEXT, "dlora_absent") == []

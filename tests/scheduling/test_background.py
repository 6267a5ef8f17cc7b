"""Background (batch) requests run only in steps without online requests."""

from __future__ import annotations

from dlora.scheduling.background import without_background

PRIORITY = {"online-1": 0, "online-2": 5, "batch-1": 1000, "batch-2": 1001}


def test_a_step_with_online_requests_runs_no_background_request():
    allowed = ["online-1", "batch-1", "online-2", "batch-2"]
    assert without_background(allowed, PRIORITY.__getitem__, 1000) == ["online-1", "online-2"]


def test_background_requests_run_when_no_online_request_is_in_the_step():
    assert without_background(["batch-2", "batch-1"], PRIORITY.__getitem__, 1000) == ["batch-2", "batch-1"]
    assert without_background([], PRIORITY.__getitem__, 1000) == []


def test_without_a_threshold_every_request_runs():
    allowed = ["online-1", "batch-1"]
    assert without_background(allowed, PRIORITY.__getitem__, None) == allowed

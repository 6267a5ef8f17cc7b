"""The step trace file: one JSON object per line, appended, per-process file name."""

from __future__ import annotations

import json
import os

from dlora.engine_ext.step_trace import StepTrace, adapter_counts, open_trace


def test_adapter_counts_names_the_base_model_empty():
    assert adapter_counts(["a", None, "a", "b", None]) == {"a": 2, "": 2, "b": 1}
    assert adapter_counts([]) == {}


def test_trace_appends_one_json_line_per_step(tmp_path):
    trace = StepTrace(tmp_path / "traces")  # created if missing
    trace.write(t=1.5, weights=None, scheduled={"a": 2})
    trace.write(t=2.0, weights="a", scheduled={"a": 1})
    trace.close()
    assert trace.path == tmp_path / "traces" / f"steps-{os.getpid()}.jsonl"
    again = StepTrace(tmp_path / "traces")  # a restarted engine in the same process appends
    again.write(t=3.0, weights=None, scheduled={})
    again.close()
    lines = [json.loads(line) for line in trace.path.read_text().splitlines()]
    assert [line["t"] for line in lines] == [1.5, 2.0, 3.0]
    assert lines[1] == {"t": 2.0, "weights": "a", "scheduled": {"a": 1}}


def test_no_directory_no_trace():
    assert open_trace(None) is None and open_trace("") is None

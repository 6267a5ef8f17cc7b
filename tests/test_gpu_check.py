"""`make gpu-check` where it can be checked without a GPU: arguments, the no-GPU exit, the report
JSON (writer and schema) and its summary. The GPU checks themselves run on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlora.gpucheck import cli, machine
from dlora.gpucheck.report import SCHEMA, Check, Report, summary, validate, write

REPO = Path(__file__).resolve().parent.parent


def _report(*checks: Check) -> Report:
    return Report(
        date="2026-01-02T03:04:05+00:00",
        git_commit="abc123",
        command="python -m dlora.gpucheck",
        machine={"gpus": [{"name": "NVIDIA H100 80GB HBM3"}], "driver": "580.65.06"},
        checks=list(checks),
    )


def test_without_a_gpu_it_says_so_exits_0_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu_check.json"
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this checks the no-GPU path on a GPU machine too.
    proc = subprocess.run(
        [sys.executable, "-m", "dlora.gpucheck", "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU found" in proc.stdout
    assert not out.exists()


def test_arguments_default_to_every_backend_and_the_results_folder():
    args = cli.parse_args([])
    assert args.backends == ("vllm", "triton", "einsum")
    assert args.out == REPO / "bench" / "gpu_check" / "result.json"
    assert not args.no_engine and not args.no_kernels
    args = cli.parse_args(["--backends", "triton, vllm", "--no-kernels", "--out", "x.json"])
    assert args.backends == ("triton", "vllm") and args.no_kernels and args.out == Path("x.json")


@pytest.mark.parametrize("bad", ["cuda", "vllm,nope", ","])
def test_unknown_backends_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--backends", bad])
    assert e.value.code == 2 and "choose from vllm, triton, einsum" in capsys.readouterr().err


def test_the_report_is_written_whole_with_date_commit_machine_and_command(tmp_path):
    report = _report(
        Check("engine[vllm]", True, 41.5, {"switch_ms": {"merge": 1.2, "unmerge": 0.8}}),
        Check("kernels_bandwidth", True, 12.0, {"copy_gbps": 2900.0}),
    )
    path = write(report, tmp_path / "results" / "gpu_check.json")
    data = json.loads(path.read_text())
    assert validate(data) == []
    assert data["schema"] == SCHEMA and data["ok"] is True
    assert (data["date"], data["git_commit"], data["command"]) == (
        "2026-01-02T03:04:05+00:00",
        "abc123",
        "python -m dlora.gpucheck",
    )
    assert data["machine"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert [c["name"] for c in data["checks"]] == ["engine[vllm]", "kernels_bandwidth"]
    assert data["checks"][0]["details"]["switch_ms"] == {"merge": 1.2, "unmerge": 0.8}
    assert not list(path.parent.glob("*.tmp"))


def test_one_failed_check_fails_the_report():
    report = _report(Check("engine[vllm]", True, 1.0), Check("engine[triton]", False, 2.0, {"error": "exit status 1"}))
    assert report.to_json()["ok"] is False
    assert not _report().ok  # no checks ran: nothing was shown to work


def test_the_schema_names_what_is_wrong():
    data = _report(Check("engine[vllm]", True, 1.0)).to_json()
    assert validate(data) == []
    broken = dict(data, date=None, ok=False, checks=[{"name": "x", "ok": "yes", "seconds": 1, "details": {}}])
    errors = validate(broken)
    assert "date: missing or not str" in errors
    assert "checks[0].ok: missing or not bool" in errors
    assert validate(dict(data, ok=False)) == ["ok: must be true exactly when there are checks and all passed"]
    assert validate(dict(data, schema="other/9")) == ["schema: 'other/9' is not 'dlora.gpu_check/1'"]
    with pytest.raises(ValueError, match="invalid gpu-check report"):
        write(_report(Check("engine[vllm]", True, 1.0, details=None)), "/nonexistent/never-written.json")


def test_the_summary_has_one_line_per_check_and_the_verdict():
    engine = {
        "phases": {"unmerged": {"ok": True}, "switching": {"ok": False}},
        "switch_ms": {"merge": 1.5, "unmerge": 0.5},
    }
    engine["headline"] = cli.engine_headline(engine)
    text = summary(
        _report(
            Check("engine[vllm]", False, 40.0, engine),
            Check("kernels_bandwidth", True, 9.0, {"headline": "copy 2900 GB/s"}),
        )
    )
    lines = text.splitlines()
    assert lines[0] == "gpu-check on NVIDIA H100 80GB HBM3 (driver 580.65.06), commit abc123"
    assert lines[1] == ("  FAIL  engine[vllm]  (40.0 s): unmerged ok, switching MISMATCH; merge 1.5 ms, unmerge 0.5 ms")
    assert lines[2] == "  PASS  kernels_bandwidth  (9.0 s): copy 2900 GB/s"
    assert lines[3] == "FAILED"


def test_the_commit_is_this_checkout():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert machine.git_commit().removesuffix("-dirty") == head


def test_the_kernel_headline_names_the_kernel_furthest_from_the_copy_bandwidth():
    details = {
        "copy_gbps": 2985.7,
        "kernels": {
            "bgmv_shrink_r16": {"kernel_of_copy": 0.12, "kernel_us": 5.7, "call_us": 66.5},
            "sgmv_shrink_r64": {"kernel_of_copy": 0.057, "kernel_us": 118.2, "call_us": 119.8},
            "merge_r16": {"kernel_of_copy": 0.36, "kernel_us": 100.0, "call_us": 101.0},
        },
    }
    assert cli.kernel_headline(details) == (
        "copy 2985.7 GB/s; slowest kernel sgmv_shrink_r64 at 6% of it (118.2 us on the GPU, 119.8 us a call)"
    )

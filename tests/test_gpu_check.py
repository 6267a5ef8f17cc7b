"""`make gpu-check` where it can be checked without a GPU: arguments, the no-GPU exit, the report
JSON (writer and schema), its summary, the verdict, and the runner's handling of a check that
fails, exits non-zero or hangs (real child processes standing in for the engine). The GPU checks
themselves run on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import dlora.gpucheck
from dlora.gpucheck import cli, engine_check, machine
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


@pytest.mark.parametrize(
    ("passed", "verdict"),
    [
        ([True], True),
        ([True, True, True, True], True),
        ([False], False),
        ([True, False, True], False),  # one failure anywhere fails the run
        ([True, True, False], False),  # ...the last one too
        ([False, False], False),
        ([], False),  # no check ran (--no-engine --no-kernels): nothing was shown to work
    ],
)
def test_the_verdict_passes_only_when_checks_ran_and_every_one_passed(passed, verdict):
    report = _report(*(Check(f"check{i}", ok, 1.0) for i, ok in enumerate(passed)))
    assert report.ok is verdict
    data = report.to_json()
    assert data["ok"] is verdict and validate(data) == []
    assert summary(report).splitlines()[-1] == ("ALL PASSED" if verdict else "FAILED")


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


# Stand-ins for one backend's engine child (`python -c CODE OUT.json`): real processes, so the
# runner meets an exit status, a hang and a result file exactly as it would with the engine.
PASSES = (
    "import json, sys; json.dump({'ok': True, 'phases': {'unmerged': {'ok': True}, 'switching': {'ok': True}},"
    " 'switch_ms': {'merge': 1.5, 'unmerge': 0.5}}, open(sys.argv[1], 'w'))"
)
MISMATCHES = (
    "import json, sys; json.dump({'ok': False, 'phases': {'unmerged': {'ok': True}, 'switching': {'ok': False}},"
    " 'switch_ms': {'merge': 1.5, 'unmerge': 0.5}}, open(sys.argv[1], 'w'))"
)
# A passing result, then a crash on the way out: the exit status alone must fail it.
EXITS_3 = PASSES + "; sys.stderr.write('CUDA error: out of memory\\n'); sys.exit(3)"
WRITES_NOTHING = "pass"
HANGS = "import time; time.sleep(60)"


def _children(monkeypatch, code_by_backend: dict[str, str]) -> None:
    def command(backend: str, out: Path) -> list[str]:
        return [sys.executable, "-c", code_by_backend[backend], str(out)]

    monkeypatch.setattr(cli, "engine_command", command)


@pytest.mark.parametrize(
    ("code", "ok", "error"),
    [
        pytest.param(PASSES, True, None, id="passes"),
        pytest.param(MISMATCHES, False, None, id="mismatches"),  # ran to the end, a phase's tokens differed
        pytest.param(EXITS_3, False, "exit status 3", id="exits-3"),
        pytest.param(WRITES_NOTHING, False, "exit status 0", id="writes-nothing"),  # exit 0 proves nothing
    ],
)
def test_an_engine_check_passes_only_on_a_result_that_says_ok(monkeypatch, code, ok, error):
    _children(monkeypatch, {"vllm": code})
    check = cli.engine_check("vllm", timeout_s=60.0)
    assert (check.name, check.ok, check.details.get("error")) == ("engine[vllm]", ok, error)
    if code == EXITS_3:
        assert "CUDA error: out of memory" in check.details["stderr_tail"]
    if code in (PASSES, MISMATCHES):
        switching = "ok" if ok else "MISMATCH"
        assert check.details["headline"] == f"unmerged ok, switching {switching}; merge 1.5 ms, unmerge 0.5 ms"


def test_an_engine_check_that_hangs_is_killed_at_its_timeout_and_fails(monkeypatch):
    _children(monkeypatch, {"vllm": HANGS})
    started = time.perf_counter()
    check = cli.engine_check("vllm", timeout_s=1.0)
    assert time.perf_counter() - started < 10  # the child sleeps 60 s: it was killed, not awaited
    assert not check.ok and check.details == {"error": "timed out after 1 s"}
    assert 1.0 <= check.seconds < 10


def test_a_kernel_check_that_raises_is_a_failed_check_naming_the_error(monkeypatch):
    def run():
        raise RuntimeError("OutOfResources: shared memory, required: 262144, hardware limit: 232448")

    monkeypatch.setattr(dlora.gpucheck, "kernel_check", SimpleNamespace(run=run), raising=False)
    check = cli.kernel_check()
    assert (check.name, check.ok) == ("kernels_bandwidth", False)
    assert check.details["error"] == (
        "RuntimeError: OutOfResources: shared memory, required: 262144, hardware limit: 232448"
    )
    assert "in run" in check.details["traceback"]


def _on_a_fake_gpu(monkeypatch) -> None:
    monkeypatch.setattr(machine, "gpu_count", lambda: 1)
    monkeypatch.setattr(machine, "git_commit", lambda: "abc123")
    monkeypatch.setattr(machine, "machine_info", lambda: {"gpus": [{"name": "NVIDIA H200"}], "driver": "580.65.06"})
    kernels = {"merge_r16": {"kernel_of_copy": 0.5, "kernel_us": 100.0, "call_us": 101.0}}
    fake = SimpleNamespace(run=lambda: {"copy_gbps": 2900.0, "kernels": kernels})
    monkeypatch.setattr(dlora.gpucheck, "kernel_check", fake, raising=False)


def test_a_failing_and_a_hanging_check_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    _on_a_fake_gpu(monkeypatch)
    _children(monkeypatch, {"vllm": EXITS_3, "triton": HANGS, "einsum": PASSES})
    out = tmp_path / "result.json"
    assert cli.main(["--out", str(out), "--engine-timeout-s", "2"]) == 1

    data = json.loads(out.read_text())
    assert validate(data) == [] and data["ok"] is False
    checks = {c["name"]: c for c in data["checks"]}
    assert list(checks) == ["engine[vllm]", "engine[triton]", "engine[einsum]", "kernels_bandwidth"]
    assert [c["ok"] for c in checks.values()] == [False, False, True, True]
    assert checks["engine[vllm]"]["details"]["error"] == "exit status 3"
    assert checks["engine[triton]"]["details"] == {"error": "timed out after 2 s"}
    assert 2.0 <= checks["engine[triton]"]["seconds"] < 10

    lines = capsys.readouterr().out.splitlines()
    progress = [line.split(" (")[0] for line in lines if line.startswith("[gpu-check]")]
    assert progress == [
        "[gpu-check] engine[vllm]: FAILED",
        "[gpu-check] engine[triton]: FAILED",
        "[gpu-check] engine[einsum]: ok",
        "[gpu-check] kernels_bandwidth: ok",
    ]
    assert lines[-2:] == ["FAILED", f"report: {out}"]


def test_when_every_check_passes_the_run_exits_0(tmp_path, monkeypatch, capsys):
    _on_a_fake_gpu(monkeypatch)
    _children(monkeypatch, dict.fromkeys(cli.BACKENDS, PASSES))
    out = tmp_path / "result.json"
    assert cli.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text())["ok"] is True
    assert capsys.readouterr().out.splitlines()[-2] == "ALL PASSED"
    # With every check skipped nothing ran, so nothing passed: the run fails.
    assert cli.main(["--out", str(out), "--no-engine", "--no-kernels"]) == 1
    data = json.loads(out.read_text())
    assert (data["checks"], data["ok"]) == ([], False)


def test_the_engine_child_takes_the_backend_and_writes_where_the_runner_reads(tmp_path, monkeypatch):
    # The real command, run in-process with the GPU work stubbed: argv order and file agree.
    cmd = cli.engine_command("triton", tmp_path / "result.json")
    assert cmd[:3] == [sys.executable, "-m", "dlora.gpucheck.engine_check"]
    monkeypatch.setattr(engine_check, "run", lambda backend: {"backend": backend, "ok": True})
    assert engine_check.main(cmd[3:]) == 0
    assert json.loads((tmp_path / "result.json").read_text()) == {"backend": "triton", "ok": True}

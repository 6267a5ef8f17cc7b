"""`python -m dlora.gpucheck`: run the GPU-only checks and write the report (`make gpu-check`)."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from dlora.gpucheck import machine
from dlora.gpucheck.report import Check, Report, summary, write

BACKENDS = ("vllm", "triton", "einsum")
DEFAULT_OUT = machine.REPO / "bench" / "gpu_check" / "result.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlora.gpucheck", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON report goes (default: %(default)s)")
    p.add_argument(
        "--backends",
        type=_backends,
        default=BACKENDS,
        help="comma-separated LoRA backends whose engine is checked (default: all: vllm,triton,einsum)",
    )
    p.add_argument("--no-engine", action="store_true", help="skip the engine checks")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel bandwidth check")
    p.add_argument(
        "--engine-timeout-s",
        type=float,
        default=600.0,
        help="limit on one backend's engine check (default: %(default)s)",
    )
    return p.parse_args(argv)


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {bad or text!r}; choose from {', '.join(BACKENDS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if machine.gpu_count() == 0:
        print("gpu-check: no CUDA GPU found (torch.cuda.is_available() is False): nothing to check, no report written")
        return 0
    report = Report(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        git_commit=machine.git_commit(),
        command=shlex.join([sys.executable, "-m", "dlora.gpucheck", *argv]),
        machine=machine.machine_info(),
    )
    if not args.no_engine:
        for backend in args.backends:
            report.checks.append(engine_check(backend, args.engine_timeout_s))
            print(summary_line(report.checks[-1]), flush=True)
    if not args.no_kernels:
        report.checks.append(kernel_check())
        print(summary_line(report.checks[-1]), flush=True)
    path = write(report, args.out)
    print(summary(report))
    print(f"report: {path}")
    return 0 if report.ok else 1


def summary_line(check: Check) -> str:
    return f"[gpu-check] {check.name}: {'ok' if check.ok else 'FAILED'} ({check.seconds:.1f} s)"


def engine_command(backend: str, out: Path) -> list[str]:
    """The child process that checks `backend`'s engine and writes its result JSON to `out`."""
    return [sys.executable, "-m", "dlora.gpucheck.engine_check", backend, str(out)]


def engine_check(backend: str, timeout_s: float) -> Check:
    """One backend's engine checks in a child process (see engine_check.py): failed if the child
    times out, exits non-zero or writes no result, else passed as the result's `ok` says."""
    started = time.perf_counter()
    name = f"engine[{backend}]"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = engine_command(backend, out)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Check(name, False, time.perf_counter() - started, {"error": f"timed out after {timeout_s:.0f} s"})
        seconds = time.perf_counter() - started
        if proc.returncode != 0 or not out.exists():
            return Check(
                name, False, seconds, {"error": f"exit status {proc.returncode}", "stderr_tail": proc.stderr[-4000:]}
            )
        result = json.loads(out.read_text())
    result["headline"] = engine_headline(result)
    return Check(name, bool(result.get("ok")), seconds, result)


def engine_headline(result: dict) -> str:
    phases = ", ".join(f"{k} {'ok' if p['ok'] else 'MISMATCH'}" for k, p in result.get("phases", {}).items())
    sw = result.get("switch_ms") or {}
    return f"{phases}; merge {sw.get('merge')} ms, unmerge {sw.get('unmerge')} ms"


def kernel_check() -> Check:
    started = time.perf_counter()
    try:
        from dlora.gpucheck import kernel_check as kc

        details = kc.run()
    except Exception as e:  # a compile error or OutOfResources is the finding: report it
        return Check(
            "kernels_bandwidth",
            False,
            time.perf_counter() - started,
            {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]},
        )
    details["headline"] = kernel_headline(details)
    return Check("kernels_bandwidth", True, time.perf_counter() - started, details)


def kernel_headline(details: dict) -> str:
    name, worst = min(details["kernels"].items(), key=lambda kv: kv[1]["kernel_of_copy"])
    return (
        f"copy {details['copy_gbps']} GB/s; slowest kernel {name} at {worst['kernel_of_copy']:.0%} of it "
        f"({worst['kernel_us']} us on the GPU, {worst['call_us']} us a call)"
    )

"""`dlora bench` end to end against a live tiny dlora server (real engine, real HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys

from dlora.bench.runner import run_benchmark
from dlora.bench.workload import WorkloadSpec, generate_workload
from tests.conftest import ADMIN_TOKEN


def test_library_run_counts_every_token_per_adapter(tiny_server):
    spec = WorkloadSpec(
        num_prompts=12,
        adapters=("a0", "a1", "a2"),
        distribution="distinct",
        input_len=16,
        output_len=8,
        request_rate=20.0,
        max_model_len=512,
        seed=1,
    )
    result = run_benchmark(
        tiny_server.url,
        generate_workload(spec),
        ignore_eos=True,
        disable_tqdm=True,
        print_result=False,
        admin_token=ADMIN_TOKEN,
    )
    assert result["completed"] == 12 and result["total_output_tokens"] == 96
    per = result["per_adapter"]
    assert {k: per[k]["completed"] for k in ("a0", "a1", "a2")} == {"a0": 4, "a1": 4, "a2": 4}
    assert result["median_ttft_ms"] > 0 and result["output_throughput"] > 0
    # The SLO report, judged against the server's own SLOs (the tiny config's relative default).
    slo = result["adapter_slo"]
    assert {k: slo["per_adapter"][k]["slo"]["source"] for k in ("a0", "a1", "a2")} == dict.fromkeys(
        ("a0", "a1", "a2"), "relative"
    )
    assert 0 <= slo["slo_attainment"] <= 1 and slo["normalized_latency"] > 0
    assert slo["coldest_adapter"] == "a0"  # four requests each: the first name


def test_cli_sweep_writes_result_and_plots(tiny_server, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlora.cli",
            "bench",
            "--base-url",
            tiny_server.url,
            "--num-prompts",
            "8",
            "--lora-modules",
            "a0",
            "a1",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--ignore-eos",
            "--sweep-rates",
            "5,inf",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
            "--plot",
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    runs = result["results"]
    assert len(runs) == 2 and all(run["completed"] == 8 for run in runs)
    assert list(tmp_path.glob("*.png"))


def test_cli_unknown_adapter_is_one_clear_line(tiny_server):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlora.cli",
            "bench",
            "--base-url",
            tiny_server.url,
            "--lora-modules",
            "nope",
            "--num-prompts",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "nope" in r.stderr and "Traceback" not in r.stderr

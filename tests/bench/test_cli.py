"""`dlora bench` flags: bad input gives one line and exit 2; runs save vLLM-named JSON, plots, sweeps.

Runs through the real `dlora` dispatcher (`dlora.cli.main`), in-process except where a real process
is needed (exit status of the module, Ctrl-C).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlora.cli import main as dlora_main

REPO = Path(__file__).resolve().parents[2]


def bench(capsys, *argv):
    try:
        code = dlora_main(["bench", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--request-rate", "abc"], "--request-rate='abc': expected a number"),
        (["--request-rate", "0"], "--request-rate='0': must be > 0"),
        (["--num-prompts", "0"], "--num-prompts='0': must be >= 1"),
        (["--num-prompts", "2.5"], "--num-prompts='2.5': expected an integer"),
        (["--burstiness", "-1"], "--burstiness='-1': must be > 0"),
        (["--cv", "2", "--burstiness", "1"], "--cv='2': give --cv or --burstiness, not both"),
        (["--metric-percentiles", "50,150"], "--metric-percentiles='50,150': percentiles must be in (0, 100]"),
        (["--percentile-metrics", "ttft,foo"], "--percentile-metrics='ttft,foo': 'foo' is not one of"),
        (["--goodput", "ttft=5"], "--goodput='ttft=5': expected KEY:MILLISECONDS"),
        (["--sweep-rates", "1,x"], "--sweep-rates='x': expected a number"),
        (["--sweep-rates", "1", "--request-rate", "2"], "give --sweep-rates or --request-rate, not both"),
        (["--max-concurrency", "0"], "--max-concurrency='0': must be >= 1"),
        (["--endpoint", "/v1/embeddings"], "--endpoint='/v1/embeddings': expected /v1/completions"),
        (["--base-url", "ftp://x"], "--base-url='ftp://x': must start with http://"),
        (["--port", "70000"], "--port='70000': must be a TCP port"),
        (["--extra-body", "[1]"], "--extra-body='[1]': expected a JSON object"),
        (["--dry-run", "--lora-alpha", "0"], "--lora-alpha='0': must be > 0"),
        (["--dry-run", "--trace-window", "5"], "--trace-window='5': expected START:END"),
        (["--dry-run", "--length-profile", "chat,poetry"], "--length-profile='poetry': unknown profile"),
        (
            ["--dry-run", "--lora-distribution", "trace", "--request-rate", "1"],
            "--trace-file=None: distribution 'trace' needs a trace file",
        ),
        (
            ["--dry-run", "--diurnal-amplitude", "1.5", "--request-rate", "1"],
            "--diurnal-amplitude=1.5: must be in [0, 1)",
        ),
        (
            ["--dry-run", "--diurnal-amplitude", "0.5"],
            "--request-rate=inf: trace replay, per-adapter arrivals and diurnal",
        ),
        (
            ["--dry-run", "--lora-assignment", "random", "--lora-distribution", "zipf"],
            "give --lora-assignment or --lora-distribution",
        ),
        (["--workload-file", "/nonexistent/w.jsonl"], "--workload-file='/nonexistent/w.jsonl': workload file"),
        (
            ["--dry-run", "--trace-file", "/nonexistent/t.csv", "--num-adapters", "2", "--request-rate", "1"],
            "No such file",
        ),
        (["--lora-distribution", "bogus"], "argument --lora-distribution: invalid choice: 'bogus'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_values_one_line_exit_2(capsys, argv, needle):
    code, out, err = bench(capsys, "--port", "9", "--disable-tqdm", *argv)
    assert code == 2
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("dlora bench: error: ")


def test_unreachable_server(capsys):
    code, _, err = bench(capsys, "--base-url", "http://127.0.0.1:9", "--num-prompts", "3", "--disable-tqdm")
    assert code == 2
    assert err.strip().splitlines() == [err.strip()]
    assert "cannot reach the server at http://127.0.0.1:9" in err


def test_unknown_adapter_is_caught_before_sending(capsys, fake):
    code, _, err = bench(
        capsys, "--base-url", fake.url, "--lora-modules", "a0", "ghost", "--num-prompts", "4", "--disable-tqdm"
    )
    assert code == 2
    assert "unknown adapter/model 'ghost': the server at" in err and "serves tiny-base, a0, a1, a2" in err
    assert fake.state.received == []


def test_too_many_adapters_requested(capsys, fake):
    code, _, err = bench(capsys, "--base-url", fake.url, "--num-adapters", "10", "--disable-tqdm")
    assert code == 2 and "--num-adapters='10': the server at" in err and "lists only 3 adapter(s)" in err


def test_run_saves_vllm_named_json_and_plots(capsys, fake, tmp_path):
    code, out, err = bench(
        capsys,
        "--base-url",
        fake.url,
        "--num-prompts",
        "30",
        "--request-rate",
        "300",
        "--lora-distribution",
        "zipf",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--ignore-eos",
        "--seed",
        "3",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--goodput",
        "ttft:5000",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "run.json",
        "--metadata",
        "note=unit",
        "--plot",
    )
    assert code == 0, err
    assert "{:=^50}".format(" Serving Benchmark Result ") in out and "P90 E2EL (ms):" in out
    res = json.loads((tmp_path / "run.json").read_text())
    for key in (
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p90_ttft_ms",
        "p99_tpot_ms",
        "p50_itl_ms",
        "mean_e2el_ms",
    ):
        assert key in res, key
    assert res["completed"] == 30 and res["total_output_tokens"] == 120 and res["request_rate"] == 300.0
    assert res["note"] == "unit" and res["model_id"] == "tiny-base"
    assert "ttfts" not in res and "itls" not in res  # per-request arrays only with --save-detailed
    assert res["workload"]["distribution"] == "zipf" and set(res["per_adapter"]) <= {"a0", "a1", "a2"}
    for suffix in ("latency_vs_rate", "per_adapter", "timeline"):
        assert (tmp_path / f"run.{suffix}.png").stat().st_size > 1000


def test_sweep_writes_one_combined_result(capsys, fake, tmp_path):
    code, out, err = bench(
        capsys,
        "--base-url",
        fake.url,
        "--num-prompts",
        "10",
        "--sweep-rates",
        "100,400",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--lora-modules",
        "a0",
        "a1",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(tmp_path),
        "--disable-tqdm",
    )
    assert code == 0, err
    files = list(tmp_path.glob("openai-sweep-100_400qps-tiny-base-*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert res["sweep_rates"] == [100.0, 400.0] and not res["interrupted"]
    assert [r["request_rate"] for r in res["results"]] == [100.0, 400.0]
    assert all(r["completed"] == 10 and len(r["ttfts"]) == 10 for r in res["results"])
    assert out.count("Serving Benchmark Result") == 2


def test_save_workload_then_replay(capsys, fake, tmp_path):
    wpath = tmp_path / "w.jsonl"
    code, out, _ = bench(
        capsys,
        "--dry-run",
        "--num-adapters",
        "2",
        "--num-prompts",
        "6",
        "--request-rate",
        "50",
        "--input-len",
        "5",
        "--output-len",
        "2",
        "--save-workload",
        str(wpath),
    )
    assert code == 0 and "workload: 6 requests" in out and "adapter-0" in out
    # the dry run names adapters adapter-0/1, which this server does not serve
    code, _, err = bench(capsys, "--base-url", fake.url, "--workload-file", str(wpath), "--disable-tqdm")
    assert code == 2 and "unknown adapter/model 'adapter-0'" in err
    code, _, _ = bench(
        capsys,
        "--dry-run",
        "--lora-modules",
        "a1",
        "a2",
        "--num-prompts",
        "6",
        "--request-rate",
        "50",
        "--input-len",
        "5",
        "--output-len",
        "2",
        "--save-workload",
        str(wpath),
    )
    code, out, err = bench(capsys, "--base-url", fake.url, "--workload-file", str(wpath), "--disable-tqdm")
    assert code == 0, err
    lines = [json.loads(x) for x in wpath.read_text().splitlines()[1:]]
    sent = fake.state.received
    assert sorted(b["prompt"] for b in sent) == sorted(x["prompt"] for x in lines)
    assert {b["model"] for b in sent} <= {"a1", "a2"}


def _default_sigint() -> None:
    # A shell's background job (`cmd &` without job control, e.g. a CI wrapper) starts with SIGINT
    # ignored, children inherit that, and Python then installs no KeyboardInterrupt handler: give
    # the child the terminal default, as a user's Ctrl-C would find it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_module(*argv, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "dlora.bench", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
        **kw,
    )


def test_module_exit_status_for_bad_value():
    p = _run_module("--request-rate", "-2")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2
    assert err.strip() == "dlora bench: error: --request-rate='-2': must be > 0 (or inf)"


def test_ctrl_c_saves_partial_result(fake, tmp_path):
    # 40 tokens -> ~2 s per request; 40 requests at 4 req/s arrive over ~10 s, so Ctrl-C after the
    # 12th arrival (+1 s: the first ones have finished) lands mid-run even if this process is
    # starved for seconds.
    fake.state.token_delay = 0.05
    p = _run_module(
        "--base-url",
        fake.url,
        "--num-prompts",
        "40",
        "--request-rate",
        "4",
        "--input-len",
        "4",
        "--output-len",
        "40",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "partial.json",
        "--disable-tqdm",
    )
    deadline = time.time() + 60
    while len(fake.state.received) < 12 and time.time() < deadline and p.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)
    assert p.poll() is None, f"the run ended before Ctrl-C: {p.communicate()}"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted: partial result saved to" in out
    res = json.loads((tmp_path / "partial.json").read_text())
    assert res["interrupted"] is True and res["num_prompts"] == 40
    assert 0 < res["completed"] < 40


def test_lengths_fit_the_servers_max_model_len(capsys, fake):
    # the fake server's card says max_model_len 256: a fixed output of 100 is kept, the prompt is cut to 156
    fake.state.token_delay = 0.0
    code, _, err = bench(
        capsys,
        "--base-url",
        fake.url,
        "--num-prompts",
        "1",
        "--input-len",
        "200",
        "--output-len",
        "100",
        "--disable-tqdm",
    )
    assert code == 0, err
    body = fake.state.received[-1]
    assert body["max_tokens"] == 100 and len(body["prompt"].split()) == 156


def test_output_len_must_fit(capsys):
    code, _, err = bench(capsys, "--dry-run", "--output-len", "4096", "--max-model-len", "2048")
    assert code == 2 and "--output-len=4096: leaves no room in max_model_len 2048" in err

"""`dlora serve` refuses bad input with one line naming the bad value, before starting anything."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from dlora import config
from dlora.app import serve_cmd
from dlora.cli import StartupError


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dlora.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--port", "99999"], "server.port=99999"),
        (["--model", "/nonexistent/model"], "model.path='/nonexistent/model'"),
        (["--config", "/nonexistent.yaml"], "'/nonexistent.yaml' does not exist"),
        (["--max-lora-rank", "7"], "engine.max_lora_rank=7"),
        # More KV cache than the machine has: refused before Ray or vLLM start (vLLM would refuse it
        # inside the replica, after loading the model).
        (["--kv-cache-space-gib", "1000000"], "engine.kv_cache_space_gib=1000000: more than this machine's memory"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    ],
)
def test_bad_values_exit_2_with_one_line(args, needle):
    r = serve(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("dlora serve: error:")]) == 1


def test_bad_configured_adapter_is_refused_before_start(tiny_model, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny_model.base}}}\nadapters: [{{name: x, path: {tmp_path / 'missing'}}}]\n")
    r = serve("--config", str(cfg))
    assert r.returncode == 2
    assert "adapters: 'x'" in r.stderr and "not a directory" in r.stderr


def test_model_directory_without_config_json_is_refused_before_start(tmp_path):
    r = serve("--model", str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert f"model.path='{tmp_path}': not a Hugging Face model directory (config.json:" in r.stderr
    assert "Traceback" not in r.stderr


def test_failure_while_starting_is_one_line_exit_1(tiny_model, tmp_path):
    """A model directory that passes the pre-start checks (a valid config.json) but has no tokenizer
    fails inside the server's start-up (before Ray): one line naming the error, no traceback unless
    --log-level debug."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model.base / "config.json", model / "config.json")
    args = ("--model", str(model), "--state-dir", str(tmp_path / "state"), "--port", "0")
    r = serve(*args)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlora serve: error:")]
    assert len(errors) == 1 and errors[0].startswith("dlora serve: error: start-up failed: ValueError: "), r.stderr
    assert "tokenizer" in errors[0] and "--log-level debug" in errors[0]
    assert "Traceback" not in r.stderr


def test_failure_while_starting_logs_its_traceback_at_debug_level(tiny_model, tmp_path, caplog):
    """What `--log-level debug` adds to the line above (in-process: the same start-up call)."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model.base / "config.json", model / "config.json")
    cfg = config.from_dict({"model": {"path": str(model)}, "server": {"state_dir": str(tmp_path / "state")}})
    with caplog.at_level(logging.DEBUG, logger=serve_cmd.__name__), pytest.raises(StartupError) as failed:
        asyncio.run(serve_cmd.start_state(cfg))
    assert str(failed.value).startswith("start-up failed: ValueError: ") and "--log-level debug" not in str(
        failed.value
    )
    (logged,) = [r for r in caplog.records if r.getMessage() == "start-up failed"]
    assert logged.exc_info is not None and logged.exc_info[0] is ValueError


def test_port_in_use_is_one_line_exit_2_before_anything_starts(tiny_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = serve("--model", str(tiny_model.base), "--state-dir", str(tmp_path / "state"), "--port", str(port))
        elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"dlora serve: error: server.port={port}: address already in use on 127.0.0.1 (another process listens "
        "there; choose another with --port)"
    ]
    # No Ray, no replica (either would have logged on stderr): the time is the interpreter's start
    # and the config's imports, far below a replica's start even on a busy machine.
    assert elapsed < 30, elapsed
    assert not (tmp_path / "state").exists()  # nothing was started, not even the registry

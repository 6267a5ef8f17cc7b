"""`dlora serve` refuses bad input with one line naming the bad value, before starting anything."""

from __future__ import annotations

import subprocess
import sys

import pytest


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlora.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["--port", "99999"], "server.port=99999"),
    (["--model", "/nonexistent/model"], "model.path='/nonexistent/model'"),
    (["--config", "/nonexistent.yaml"], "'/nonexistent.yaml' does not exist"),
    (["--max-lora-rank", "7"], "engine.max_lora_rank=7"),
])
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

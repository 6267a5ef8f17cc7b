"""Server processes of the benchmark scripts (dlora/bench/servers.py): healthy inside `serving`,
stopped after it, all of them, also when one never comes up. Small real processes, no engines."""

from __future__ import annotations

import socket
import sys

import httpx
import pytest

from dlora.bench.servers import serving, start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_servers_are_healthy_inside_the_block_and_stopped_after(tmp_path):
    (tmp_path / "health").write_text("ok")  # a static file server answers GET /health with it
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    proc = start(cmd, tmp_path / "web.log")
    url = f"http://127.0.0.1:{port}"
    with serving({"web": proc}, {"web": url}, tmp_path, timeout=60):
        assert proc.poll() is None
        assert httpx.get(f"{url}/health", timeout=5).text == "ok"
    assert proc.poll() is not None


def test_a_server_that_exits_stops_the_others_and_names_its_log(tmp_path):
    alive = start([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "alive.log")
    dead = start([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "dead.log")
    nowhere = f"http://127.0.0.1:{free_port()}"
    logs = {"dead": tmp_path / "own-dead.log", "alive": tmp_path / "alive.log"}
    with pytest.raises(RuntimeError, match=r"exited \(3\); see .*own-dead\.log"):
        with serving({"dead": dead, "alive": alive}, {"dead": nowhere, "alive": nowhere}, tmp_path, 60, logs):
            pytest.fail("the block ran without a healthy server")
    assert alive.poll() is not None

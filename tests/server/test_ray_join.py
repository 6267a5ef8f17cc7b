"""`dlora serve --ray-address` joins a Ray cluster someone else started (`ray start --head`) and
leaves it running when it stops.

The cluster here is a real one on this machine, bound to 127.0.0.1. Two settings make that work
and would not be needed on a real cluster: Ray turns a 127.0.0.1 address into the machine's
outward IP unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps everything on loopback, and `ray start`
enables token authentication, so every process gets the token through RAY_AUTH_TOKEN (a
generated one, so ~/.ray/auth_token is neither read nor written) and RAY_AUTH_MODE=token.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests import harness

pytestmark = pytest.mark.engine  # a `ray start --head` cluster, joined by `dlora serve`

RAY = str(Path(sys.executable).parent / "ray")


def ray_env(token: str) -> dict[str, str]:
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A 2-CPU Ray head on 127.0.0.1 (its own process group, killed with it); yields (address, env).
    One for the module: each test leaves it as it found it (the first checks that it does)."""
    port = harness.free_port()
    temp = Path(os.path.realpath("/tmp")) / f"rh{port}"  # unix socket paths must stay short
    env = ray_env(secrets.token_hex(32))
    log = open(tmp_path_factory.mktemp("ray") / "head.log", "wb")
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--include-dashboard",
            "false",
            "--temp-dir",
            str(temp),
            "--disable-usage-stats",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **env},
    )
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while cpus(address, env) is None:
            assert head.poll() is None, f"ray start exited with {head.returncode}"
            assert time.monotonic() < deadline, "the Ray head did not come up in 120 s"
            time.sleep(2)
        yield address, env
    finally:
        # Ray's own graceful stop takes about 30 s; nothing of this throwaway cluster needs it.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def cpus(address: str, env: dict[str, str]) -> tuple[float, float] | None:
    """(available, total) CPUs of the cluster, asked by a driver of its own; None if unreachable."""
    code = (
        f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
        "print(ray.available_resources().get('CPU', 0.0), ray.cluster_resources().get('CPU', 0.0))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env={**os.environ, **env}
    )
    if r.returncode != 0:
        return None
    available, total = r.stdout.split()[-2:]
    return float(available), float(total)


def test_serve_joins_an_existing_cluster_places_its_replicas_there_and_leaves_it_running(
    ray_head, tiny_model, tmp_path, monkeypatch
):
    address, env = ray_head
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the server process inherits them
    cfg = harness.tiny_config(
        tiny_model, tmp_path / "state", harness.free_port(), cluster={"num_replicas": 2, "ray_address": address}
    )
    server = harness.launch(tmp_path, cfg)
    try:
        assert httpx.get(f"{server.url}/health", timeout=30).json()["replicas_healthy"] == 2
        # both replica actors hold their CPU in the joined cluster (none is left for a third)
        assert cpus(address, env) == (0.0, 2.0)
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            json={"model": "a1", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.tail()
    # the cluster is still up, with the replicas' CPUs free again
    deadline = time.monotonic() + 60
    while (got := cpus(address, env)) != (2.0, 2.0) and time.monotonic() < deadline:
        time.sleep(2)
    assert got == (2.0, 2.0)


def test_joining_without_the_clusters_token_fails_in_one_line_naming_the_cause(ray_head, tiny_model, tmp_path):
    address, env = ray_head
    cfg = harness.tiny_config(
        tiny_model, tmp_path / "state", harness.free_port(), cluster={"num_replicas": 1, "ray_address": address}
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    no_token = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    r = subprocess.run(
        [sys.executable, "-m", "dlora.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**no_token, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HOME": str(tmp_path)},
    )
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dlora serve: error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith(
        f"dlora serve: error: start-up failed: RayJoinError: cluster.ray_address='{address}': "
        "could not join the Ray cluster: the cluster uses token authentication"
    ), errors[0]
    assert "RAY_AUTH_MODE=token" in errors[0] and "Traceback" not in r.stderr

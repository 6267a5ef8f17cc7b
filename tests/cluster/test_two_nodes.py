"""Adapters reach replicas on any node of a Ray cluster by their content, not by the API server's
path: a two-node cluster on this machine, whose second node runs in its own mount namespace where
the server's state dir (its adapter snapshots) and the node cache dir are empty tmpfs mounts, as on
a machine of its own. One replica on each node (`cluster.replica_resources`), least-loaded
dispatch, so two requests at once go one to each.

Adapters registered by config, at run time, found lazily in an S3 store, updated in place and
unloaded all answer on both replicas with Hugging Face + PEFT's greedy tokens; the second node's
replica reads them from its node cache. Then the second node dies while streams run on it, and
every stream completes on the first.

Ray's nodes on one machine: `ray start` enables token authentication (every process gets a
generated token through RAY_AUTH_TOKEN), and adds a second node only with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, which puts every node, and the server, on the machine's IP.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests import harness

pytestmark = pytest.mark.engine  # a two-node Ray cluster and a `dlora serve` joined to it

RAY = str(Path(sys.executable).parent / "ray")
PROMPT = "def f("
NODE_UP_S = 120
NODE_TRIES = 3
TOKENS = 16  # per request: the pair sent at once is in flight together
STREAM_TOKENS = 440  # long enough to be running when the node dies (max_model_len 512)


def ray_env(token: str) -> dict[str, str]:
    return {
        # `ray start --address` adds a node only with this set; Ray then uses the machine's own IP
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        # a dead node is declared dead in ~3 s, not Ray's default ~30 s
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }


def resources(address: str, env: dict[str, str]) -> dict[str, float]:
    code = (
        f"import json, ray; ray.init(address={address!r}, logging_level='ERROR'); "
        "print(json.dumps(ray.cluster_resources()))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    return json.loads(r.stdout.splitlines()[-1]) if r.returncode == 0 else {}


def wait_for_resource(name: str, address: str, env: dict[str, str], procs: list[subprocess.Popen]) -> bool:
    """Whether a node with resource `name` joined before one of `procs` exited."""
    deadline = time.monotonic() + NODE_UP_S
    while resources(address, env).get(name, 0) < 1:
        if any(p.poll() is not None for p in procs):
            return False
        assert time.monotonic() < deadline, f"no node with {name} after {NODE_UP_S} s"
        time.sleep(1)
    return True


def namespace_pids(ns: str) -> list[int]:
    """Every process in the mount namespace `ns`: the second node's raylet, workers and replica."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == ns:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def own_namespace(proc: subprocess.Popen) -> str:
    """The mount namespace `proc` entered (unshare's), once it has."""
    mine = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + 30
    while (ns := os.readlink(f"/proc/{proc.pid}/ns/mnt")) == mine:
        assert proc.poll() is None and time.monotonic() < deadline, "unshare did not enter a mount namespace"
        time.sleep(0.05)
    return ns


def kill_namespace(ns: str | None) -> None:
    if ns is None:
        return
    for pid in namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class TwoNodes:
    def __init__(self, tmp: Path):
        self.port = harness.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp = Path(os.path.realpath("/tmp")) / f"tn{self.port}"  # unix socket paths stay short
        self.env = {**os.environ, **ray_env(secrets.token_hex(32))}
        self.state_dir, self.cache_dir = tmp / "state", tmp / "node-cache"
        self.logs = tmp
        self.head: subprocess.Popen | None = None
        self.second: subprocess.Popen | None = None
        self.second_ns: str | None = None

    def start(self) -> None:
        for d in (self.state_dir, self.cache_dir, self.temp):
            d.mkdir(parents=True, exist_ok=True)
        common = ["--num-cpus", "1", "--disable-usage-stats", "--block"]
        # A loaded machine can miss `ray start`'s fixed 30 s wait for its raylet: each start is tried again.
        for _ in range(NODE_TRIES):
            self.head = self._start_head(common)
            if wait_for_resource("head_node", self.address, self.env, [self.head]):
                break
            kill_group(self.head)  # what the failed start left behind
        else:
            raise AssertionError(f"no Ray head: {(self.logs / 'head.log').read_text()[-2000:]}")
        for _ in range(NODE_TRIES):
            self.second = self._start_second(common)
            self.second_ns = own_namespace(self.second)
            if wait_for_resource("second_node", self.address, self.env, [self.head, self.second]):
                break
            kill_namespace(self.second_ns)
        else:
            raise AssertionError(f"no second node: {(self.logs / 'second.log').read_text()[-2000:]}")

    def _start_head(self, common: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            [RAY, "start", "--head", "--port", str(self.port), "--include-dashboard", "false"]
            + ["--temp-dir", str(self.temp), "--resources", '{"head_node": 1}', *common],
            stdout=open(self.logs / "head.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )

    def _start_second(self, common: list[str]) -> subprocess.Popen:
        """The second node, in a mount namespace of its own where the server's state dir and the
        node cache dir are empty tmpfs mounts. unshare refused (no privilege) fails the test."""
        second = [RAY, "start", "--address", self.address, "--resources", '{"second_node": 1}', *common]
        mounts = f"mount -t tmpfs tmpfs {self.state_dir} && mount -t tmpfs tmpfs {self.cache_dir}"
        return subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mounts} && exec {shlex.join(second)}"],
            stdout=open(self.logs / "second.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
        )

    def second_node_path(self, path: Path) -> Path:
        """`path` as the second node sees it (through its processes' root, in its namespace)."""
        assert self.second is not None
        return Path(f"/proc/{self.second.pid}/root{path}")

    def kill_second(self) -> None:
        kill_namespace(self.second_ns)
        if self.second is not None:
            self.second.wait(timeout=30)

    def stop(self) -> None:
        kill_namespace(self.second_ns)
        for p in (self.second, self.head):
            if p is not None:
                kill_group(p)
        shutil.rmtree(self.temp, ignore_errors=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill `proc`'s process group (started with setsid: the `ray start` and every process it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def complete(url: str, model: str, max_tokens: int = 6) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=180,
        json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True},
    )
    assert r.status_code == 200, (model, r.status_code, r.text)
    return r.json()["choices"][0]


def resident_on(url: str) -> dict[str, set[int]]:
    listed = httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]
    return {a["name"]: set(a["resident_on"]) for a in listed}


def served_on_both(url: str, oracle, name: str, weights: str) -> None:
    """Two requests at once (least-loaded dispatch: one per replica), each HF + PEFT's greedy tokens."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        choices = list(pool.map(lambda _: complete(url, name, TOKENS), range(2)))
    for choice in choices:
        assert choice["token_ids"] == oracle.greedy(weights, choice["prompt_token_ids"], TOKENS), name


def wait_resident_on_both(url: str, names: list[str]) -> None:
    deadline = time.monotonic() + 30
    while not all(resident_on(url).get(n) == {0, 1} for n in names):
        assert time.monotonic() < deadline, resident_on(url)
        time.sleep(0.5)


def stream(url: str, model: str, max_tokens: int, started: threading.Barrier) -> tuple[list[int], str | None]:
    """A streamed completion's tokens and finish reason; waits at `started` once its first came."""
    tokens: list[int] = []
    reason = None
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["return_token_ids"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                first = not tokens
                tokens += choice.get("token_ids") or []
                reason = choice.get("finish_reason") or reason
                if first and tokens:
                    started.wait(timeout=120)
    return tokens, reason


def resubmissions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(r"^dlora_request_resubmissions(?:_total)? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_adapters_answer_on_both_nodes_and_streams_survive_the_second(
    tiny_model, oracle, s3_adapter_store, tmp_path, monkeypatch
):
    nodes = TwoNodes(tmp_path)
    server = None
    try:
        nodes.start()
        cfg = harness.tiny_config(
            tiny_model,
            nodes.state_dir,
            harness.free_port(),
            cluster={
                "num_replicas": 2,
                "ray_address": nodes.address,
                "replica_resources": ["head_node", "second_node"],
                "dispatch": "least_loaded",
                "migration": False,
            },
            **{
                "engine.node_cache_dir": str(nodes.cache_dir),
                "engine.max_cpu_loras": 8,  # every adapter here stays loaded where it ran
                "server.resolve_adapters": True,
                "server.adapter_s3_uri": "s3://adapters/tenants",
                "server.adapter_s3_endpoint_url": s3_adapter_store,
            },
        )
        for k, v in ray_env(nodes.env["RAY_AUTH_TOKEN"]).items():
            monkeypatch.setenv(k, v)  # the server process inherits them
        server = harness.launch(tmp_path / "server", cfg)
        url = server.url
        assert httpx.get(f"{url}/health", timeout=30).json()["replicas_healthy"] == 2

        # by config (a0 pinned, a1 not), at run time, and found by name in the S3 store (a copy of a3)
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "rt", "lora_path": str(tiny_model.adapters["a2"])},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        for name, weights in (("a0", "a0"), ("a1", "a1"), ("rt", "a2"), ("from-s3", "a3")):
            served_on_both(url, oracle, name, weights)
        wait_resident_on_both(url, ["a0", "a1", "rt", "from-s3"])
        # the second node read them from its own cache, by digest: the server's snapshots are not there
        remote_cache = nodes.second_node_path(nodes.cache_dir)
        assert len([p for p in remote_cache.iterdir() if len(p.name) == 64]) >= 4
        assert not any(nodes.second_node_path(nodes.state_dir).iterdir())

        # an in-place update: the new weights on both replicas
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "rt", "lora_path": str(tiny_model.adapters["a1"]), "load_inplace": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        served_on_both(url, oracle, "rt", "a1")
        # an unload: gone everywhere
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"}, timeout=120)
        assert r.status_code == 200, r.text
        gone = httpx.post(f"{url}/v1/completions", json={"model": "rt", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert gone.status_code == 404, gone.text

        # the second node dies while streams run on both replicas (two each): every stream completes
        prompt_ids = complete(url, "tiny-base")["prompt_token_ids"]
        models = ("a0", "a1", "a0", "a1")
        started = threading.Barrier(len(models) + 1)
        with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
            runs = [pool.submit(stream, url, name, STREAM_TOKENS, started) for name in models]
            started.wait(timeout=120)  # every stream has its first tokens
            nodes.kill_second()
            results = [f.result(timeout=150) for f in runs]
        for (tokens, reason), weights in zip(results, models):
            assert (
                reason in ("length", "stop")
                and tokens == oracle.greedy(weights, prompt_ids, STREAM_TOKENS)[: len(tokens)]
            )
            assert reason == "stop" or len(tokens) == STREAM_TOKENS
        assert resubmissions(url) >= 1  # the node died under running streams, which went on on the first
        replicas = httpx.get(f"{url}/v1/replicas", timeout=30).json()["data"]
        assert [r["state"] for r in replicas if r["id"] == 0] == ["serving"]
    finally:
        if server is not None:
            server.stop()
        nodes.stop()

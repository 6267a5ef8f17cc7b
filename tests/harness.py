"""Start a real `dlora serve` process on 127.0.0.1 for integration tests, and stop it cleanly."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from dlora import env

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 420  # generous: engines start in ~35 s alone, minutes on a busy machine


# Below the kernel's ephemeral range (32768+), where Ray's own processes bind random ports after
# the test picked ours, and above Ray's worker ports (10002-19999).
PORT_RANGE = (20000, 32000)
START_ATTEMPTS = 3  # a port taken between picking and binding is retried with another
# KV blocks (128 tokens each on CPU) of every tiny-model engine in the suite: 32,768 tokens, twice
# what max_num_seqs x max_model_len can hold. Sized by blocks, not GiB: allocating a GiB of KV cache
# took 5 of the engine's 15 seconds of start-up CPU, for space no test uses.
TINY_KV_BLOCKS = 256
TOY_API_KEY = "sk-test-tenant"  # the API key of the shared toy server (tests/conftest.py)


def free_port() -> int:
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def metric(url: str, series: str) -> float:
    """The value of one series in the server's /metrics: a name, or a name with its labels as
    rendered (`dlora_admission_refused_total{reason="overloaded"}`)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(series + " ") or line.startswith(series + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(series)


def stats_reads(url: str) -> float:
    """Rounds of replica stats the server's balancer has read."""
    return metric(url, "dlora_replica_stats_reads_total")


def wait_for_fresh_stats(url: str, timeout_s: float = 60) -> None:
    """Wait until the replica gauges in /metrics were read after this call: two more rounds (the
    first may have begun before what the caller just did)."""
    wanted = stats_reads(url) + 2
    deadline = time.monotonic() + timeout_s
    while stats_reads(url) < wanted:
        assert time.monotonic() < deadline, "the balancer's loop stopped reading replica stats"
        time.sleep(0.1)


def tiny_config(model, state_dir: Path, port: int, **overrides) -> dict:
    """A config serving the tiny test model in fp32 (exact comparisons against HF)."""
    cfg = {
        "model": {"path": str(model.base), "served_name": "tiny-base", "dtype": "float32", "max_model_len": 512},
        "engine": {
            "max_loras": 2,
            "max_lora_rank": 8,
            "max_cpu_loras": 4,
            "kv_cache_space_gib": 1,
            "max_num_seqs": 32,
            "num_kv_blocks": TINY_KV_BLOCKS,
            # JSON outputs without free whitespace: the tiny model, never trained for JSON, would
            # otherwise emit whitespace until max_tokens instead of a value that parses
            "structured_outputs_backend": "xgrammar",
            "structured_outputs_disable_any_whitespace": True,
        },
        "server": {
            "port": port,
            "state_dir": str(state_dir),
            "adapter_roots": [str(model.base.parent)],
            # vLLM answers tools with tool_choice named, required or auto only with these set; this
            # parser leaves named and required calls to a JSON schema (others use their own tags)
            "tool_call_parser": "pythonic",
            "enable_auto_tool_choice": True,
            # usage.prompt_tokens_details.cached_tokens, as vLLM reports it with the same flag
            "enable_prompt_tokens_details": True,
        },
        "adapters": [
            {"name": "a0", "path": str(model.adapters["a0"]), "pinned": True},
            {"name": "a1", "path": str(model.adapters["a1"])},
            {"name": "a2", "path": str(model.adapters["a2"])},
        ],
    }
    return apply_overrides(cfg, overrides)


# dlora's policy with thresholds and credits set to switch between merged and unmerged steps often
# (for testing only; the defaults switch far less), and the same running the unmerged adapters
# in the merged steps (`mixed_merged`, on dlora's einsum kernels).
SWITCH_OFTEN = {
    "policy": "dlora",
    "alpha": 0.2,
    "beta": 0.1,
    "t_starve": 0.12,
    "t_normal": 0.08,
    "initial_credit": 0.04,
    "break_period_iters": 4,
}
SWITCH_OFTEN_MIXED = {**SWITCH_OFTEN, "mixed_merged": True}


def apply_overrides(cfg: dict, overrides: dict) -> dict:
    """Set "section.key": value (or a whole "section": {...}) in a config dict; returns it."""
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if key:
            cfg[section][key] = value
        else:
            cfg[section] = value
    return cfg


@dataclass
class ServerProcess:
    config_path: Path
    log_path: Path
    port: int
    toy: bool = False  # tests/toy_serve.py: toy replicas instead of engines
    proc: subprocess.Popen | None = None
    _stopping: threading.Thread | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        """Serving or starting; not once told to stop, though it may still be shutting down."""
        return self.proc is not None and self.proc.poll() is None and self._stopping is None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.wait_stopped()  # the same port and state dir
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *(("tests.toy_serve",) if self.toy else ("dlora.cli", "serve"))]
            + ["--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,  # where `tests` is importable
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dlora serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # a start takes tens of seconds: no need to add up to a second idle
        self.stop()
        raise TimeoutError(f"dlora serve not healthy after {START_TIMEOUT_S}s:\n{self.tail()}")

    def stop(self, wait: bool = True) -> None:
        """SIGINT: the server drains and exits (killed if it has not within a minute). `wait=False`
        returns at once, so that a test's next work overlaps the seconds Ray and the engines take
        to shut down; `start()` and `wait_for_stopped_servers()` wait for the exit."""
        if not self.running:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self._stopping = threading.Thread(target=self._reap, args=(self.proc,), daemon=True)
        self._stopping.start()
        _STOPPING.append(self)
        if wait:
            self.wait_stopped()

    @staticmethod
    def _reap(proc: subprocess.Popen) -> None:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def wait_stopped(self) -> None:
        if self._stopping is not None:
            self._stopping.join()
            self._stopping = None

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


_STOPPING: list[ServerProcess] = []


def wait_for_stopped_servers() -> None:
    """Every server told to stop has exited (at the end of the run: none outlives it)."""
    while _STOPPING:
        _STOPPING.pop().wait_stopped()


def launch(tmp_dir: Path, cfg: dict, toy: bool = False) -> ServerProcess:
    """Start a server on cfg's port; if something else took that port first, on another (written
    back into `cfg`, so a caller that relaunches the same config gets the port that worked).
    `toy`: over toy replicas, no engine (tests/toy_serve.py)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    path = tmp_dir / "config.yaml"
    for attempt in range(START_ATTEMPTS):
        path.write_text(yaml.safe_dump(cfg))
        server = ServerProcess(path, tmp_dir / "server.log", cfg["server"]["port"], toy)
        offset = server.log_path.stat().st_size if server.log_path.exists() else 0
        try:
            return server.start()
        except RuntimeError:
            this_run = server.log_path.read_bytes()[offset:].decode(errors="replace")
            if attempt + 1 == START_ATTEMPTS or "address already in use" not in this_run:
                raise
            cfg["server"]["port"] = free_port()
        finally:
            if env.DLORA_TEST_KEEP_LOGS.get():
                print(server.tail(200))
    raise AssertionError("unreachable")

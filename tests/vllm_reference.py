"""vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`) on the tiny model, as the reference
dlora's API is held to (tests/server/test_vllm_parity.py).

Starting it costs most of a minute, so it is started at most once per list of requests: its answers
are written to a file next to the test model, named by a hash of the model directory, the requests,
its command line and engine environment and vLLM's version, and a later run (or the other xdist
worker) reads that file.
A file lock makes the worker that comes second wait for the first one's answers instead of
starting a second server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from filelock import FileLock

from dlora import config
from dlora.config import DloraConfig
from dlora.replica.engine import engine_kwargs
from dlora.replica.ray_replica import replica_runtime_env
from dlora.server.state import base_model_name
from tests import harness

REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
# Waiting for the other worker's answers (its server start and every request, on a busy machine),
# within pytest's own timeout (pyproject.toml) so that the wait fails with its own error.
LOCK_TIMEOUT_S = 600
# A replica's engine arguments (dlora.replica.engine.engine_kwargs) that are dlora's own (its
# scheduler, worker extension and their settings, the priority order its migration keeps, the
# logits processor that corrects a moved request's penalties) or that change no answer to one
# request at a time: the reference runs vLLM's own in their place.
DLORA_ONLY_ARGS = frozenset(
    {
        "worker_extension_cls",
        "scheduler_cls",
        "additional_config",
        "logits_processors",
        "scheduling_policy",
        "async_scheduling",
        "disable_log_stats",
    }
)
# A replica's environment (dlora.replica.ray_replica.replica_runtime_env) that decides how vLLM
# computes on CPU: the same kernels and thread count, on the core the xdist worker is pinned to
# (tests/schedule.py; the server inherits the pinning), the same KV cache, and the worker inside
# the engine-core process (one process less to start).
ENGINE_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "OMP_NUM_THREADS",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
)
# What vLLM's server builds its chat serving from, by the flag of the same name (dlora.server.vllm_frontend).
SERVER_FLAGS = (
    "tool_call_parser",
    "enable_auto_tool_choice",
    "reasoning_parser",
    "chat_template",
    "enable_prompt_tokens_details",
)


@dataclasses.dataclass(frozen=True)
class Call:
    """One request: posted as JSON to `path`; a body with `"stream": true` is read as server-sent
    events. Sent `times` times in a row, the last answer is the one compared (a repeat shows what
    the first left behind: a prefix cache)."""

    name: str
    path: str
    body: dict
    times: int = 1


def send(client: httpx.Client, url: str, call: Call) -> dict:
    """The last answer to `call` as JSON data: `status`, and `body` (the JSON response or error) or,
    for a stream answered 200, `chunks` (each event's JSON) and `done` (whether `[DONE]` ended it)."""
    for _ in range(call.times - 1):
        _send_once(client, url, call)
    return _send_once(client, url, call)


def _send_once(client: httpx.Client, url: str, call: Call) -> dict:
    if not call.body.get("stream"):
        r = client.post(url + call.path, json=call.body)
        return {"status": r.status_code, "body": r.json()}
    with client.stream("POST", url + call.path, json=call.body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(r.read())}
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    return {"status": 200, "chunks": [json.loads(e) for e in events[: -1 if done else None]], "done": done}


def answers(model, calls: list[Call]) -> dict[str, dict]:
    """vLLM's answers to `calls` by name: from the cache file next to `model`, else from a server
    started for them (once, whichever worker comes first)."""
    path = cache_path(model, calls)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S):
        if not path.exists():
            with reference_server(model, path.parent / "server.log") as url:
                result = collect(url, calls)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
            tmp.replace(path)
    return json.loads(path.read_text())


def collect(url: str, calls: list[Call]) -> dict[str, dict]:
    """One call at a time: the answers must not depend on what else is in the batch."""
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        return {call.name: send(client, url, call) for call in calls}


def cache_path(model, calls: list[Call]) -> Path:
    key = {
        "model": str(Path(model.base).resolve()),
        "vllm": vllm_version(),
        "command": command(model, port=0),
        "env": engine_env(model),
        "calls": [dataclasses.asdict(call) for call in calls],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(model.base).parent / "vllm-reference" / f"{digest}.json"


def vllm_version() -> str:
    from vllm import __version__  # imported late: torch comes with it

    return __version__


def shared_server_config(model) -> DloraConfig:
    """The config of the shared dlora servers on the tiny model (tests/harness.tiny_config)."""
    return config.from_dict(harness.tiny_config(model, Path("unused"), port=0))


def command(model, port: int) -> list[str]:
    """vLLM's server as the shared dlora servers run it: the same engine arguments as their replicas
    (less dlora's own), served names, adapters and chat serving options."""
    cfg = shared_server_config(model)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    for key, value in engine_kwargs(cfg, cfg.model.path).items():
        if key not in DLORA_ONLY_ARGS:
            argv += flag(key, value)
    for key in SERVER_FLAGS:
        argv += flag(key, getattr(cfg.server, key))
    argv += ["--served-model-name", base_model_name(cfg, cfg.model.path)]
    argv += ["--lora-modules", *(f"{a.name}={a.path}" for a in cfg.adapters)]
    return argv + ["--host", "127.0.0.1", "--port", str(port)]


def flag(key: str, value: object) -> list[str]:
    """`key=value` on vLLM's command line: booleans as --x / --no-x, a list as its values, a config
    object as the JSON of the fields it sets apart from their defaults; None leaves vLLM's default."""
    name = "--" + key.replace("_", "-")
    if value is None:
        return []
    if isinstance(value, bool):
        return [name if value else "--no-" + name[2:]]
    if isinstance(value, list | tuple):
        return [name, *map(str, value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        default = type(value)()
        changed = {
            f.name: getattr(value, f.name)
            for f in dataclasses.fields(value)
            if getattr(value, f.name) != getattr(default, f.name)
        }
        return [name, json.dumps(changed)]
    return [name, str(value)]


def engine_env(model) -> dict[str, str]:
    replica_env = replica_runtime_env(shared_server_config(model))["env_vars"]
    return {key: replica_env[key] for key in ENGINE_ENV}


@contextlib.contextmanager
def reference_server(model, log_path: Path) -> Iterator[str]:
    """vLLM's server, healthy, on a free port; yields its URL and stops it (with its engine process)."""
    for attempt in range(harness.START_ATTEMPTS):
        port = harness.free_port()
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command(model, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ | engine_env(model),
                start_new_session=True,  # its engine process is in its group, and stops with it
            )
        url = f"http://127.0.0.1:{port}"
        try:
            if _healthy(proc, url):
                yield url
                return
            this_start = log_path.read_bytes()[offset:].decode(errors="replace")
            if attempt + 1 == harness.START_ATTEMPTS or "address already in use" not in this_start:
                tail = "\n".join(this_start.splitlines()[-60:])
                raise RuntimeError(f"vLLM's server did not start (exit {proc.returncode}):\n{tail}")
        finally:
            _stop(proc)


def _healthy(proc: subprocess.Popen, url: str) -> bool:
    """True once it answers /health; False if it exits first (or does not answer in time)."""
    deadline = time.monotonic() + harness.START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

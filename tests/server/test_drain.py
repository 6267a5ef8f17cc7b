"""SIGTERM/SIGINT drain a `dlora serve` process: /health and new requests get 503, running streams
finish with [DONE] (or, at server.drain_timeout_s, an error event and [DONE]), then the process
exits. The drain is the HTTP layer's: the deadline and second-signal cases run over toy replicas
(tests/toy_serve.py, the real app, uvicorn and signal handling), the graceful drain on real engines:
the shared `tiny_server`, which it ends (a later user of it starts it again)."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests import harness

pytestmark = pytest.mark.engine  # `dlora serve` processes

MAX_TOKENS = 450  # ~4 s of decoding for one tiny-model stream on a quiet core; three run together
MODELS = ("tiny-base", "a1", "a2")


@dataclass
class Stream:
    """A streamed completion read on its own thread: every `data:` payload, in order."""

    url: str
    model: str
    events: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def start(self) -> Stream:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        body = {
            "model": self.model,
            "prompt": "def f(",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=180) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except BaseException as e:  # the test thread reports it
            self.error = e
        finally:
            self.done.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def tokens(self) -> int:
        return sum(len(ch["token_ids"]) for c in self.chunks() for ch in c.get("choices", ()))


@pytest.fixture
def launch(tiny_model, tmp_path):
    servers = []

    def start(drain_timeout_s: float) -> harness.ServerProcess:
        """A server over toy replicas with this drain deadline."""
        cfg = harness.tiny_config(
            tiny_model, tmp_path / "state", harness.free_port(), **{"server.drain_timeout_s": drain_timeout_s}
        )
        servers.append(harness.launch(tmp_path, cfg, toy=True))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def start_streams(url: str) -> list[Stream]:
    streams = [Stream(url, m).start() for m in MODELS]
    deadline = time.monotonic() + 120
    while not all(len(s.events) >= 3 for s in streams):  # every stream is generating
        assert time.monotonic() < deadline and not any(s.done.is_set() for s in streams), [
            (s.events[-3:], s.error) for s in streams
        ]
        time.sleep(0.02)
    return streams


def wait_exit(server: harness.ServerProcess, timeout_s: float) -> int:
    return server.proc.wait(timeout=timeout_s)


def wait_draining(server: harness.ServerProcess) -> httpx.Response:
    """/health once it says draining (the signal handler runs on the server's next loop turn)."""
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{server.url}/health", timeout=10)).status_code != 503:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.02)
    return health


@pytest.mark.ends_shared_server
def test_sigterm_lets_running_streams_finish_and_refuses_new_work(tiny_server):
    server = tiny_server
    log_start = server.log_path.stat().st_size  # the log holds the server's earlier life too
    streams = start_streams(server.url)
    server.proc.send_signal(signal.SIGTERM)
    health = wait_draining(server)
    refused = httpx.post(
        f"{server.url}/v1/completions", timeout=10, json={"model": "tiny-base", "prompt": "x", "max_tokens": 2}
    )
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=10,
        json={"model": "a1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert not any(s.done.is_set() for s in streams), "the streams ended before the drain could be observed"

    assert health.status_code == 503 and health.json()["status"] == "draining"
    for r in (refused, chat):
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError" and err["code"] == 503 and "shutting down" in err["message"]
        assert int(r.headers["retry-after"]) >= 1

    assert wait_exit(server, 150) == 0, server.tail()
    for s in streams:
        assert s.done.is_set() and s.error is None, s.error
        assert s.events[-1] == "[DONE]"
        chunks = s.chunks()
        assert not any("error" in c for c in chunks), chunks[-3:]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS == s.tokens()
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    log = server.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "SIGTERM: draining 3 request(s)" in log
    assert "Application shutdown complete" in log and "Traceback" not in log


def test_streams_still_running_at_the_drain_deadline_end_with_an_error_then_done(launch):
    server = launch(drain_timeout_s=1)
    streams = start_streams(server.url)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for s in streams:
        assert s.done.wait(60)
    ended_after = time.monotonic() - t0
    assert wait_exit(server, 90) == 0, server.tail()

    assert ended_after < 30, ended_after  # at the deadline (1 s), not when the 450 tokens were done
    for s in streams:
        assert s.error is None, s.error
        assert s.events[-1] == "[DONE]"
        last = json.loads(s.events[-2])
        assert last["error"]["code"] == 503 and last["error"]["type"] == "ServiceUnavailableError"
        assert "server.drain_timeout_s=1s" in last["error"]["message"]
        assert 0 < s.tokens() < MAX_TOKENS
    assert "drain timeout: ending 3 request(s) still running" in server.log_path.read_text(errors="replace")


def test_a_second_signal_during_the_drain_stops_at_once(launch):
    server = launch(drain_timeout_s=120)
    streams = start_streams(server.url)
    server.proc.send_signal(signal.SIGTERM)
    wait_draining(server)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    for s in streams:
        assert s.done.wait(30)
        assert s.error is None and s.events[-1] == "[DONE]", (s.error, s.events[-2:])
        assert json.loads(s.events[-2])["error"]["code"] == 503
    assert wait_exit(server, 60) == 128 + signal.SIGINT, server.tail()
    assert time.monotonic() - t0 < 30
    assert "SIGINT during the drain: stopping now" in server.log_path.read_text(errors="replace")

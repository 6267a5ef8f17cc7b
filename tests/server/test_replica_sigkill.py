"""A replica's process SIGKILLed in the middle of several streams on the shared two-replica server
(tests/conftest.py): every stream completes with exactly the tokens of an undisturbed run (the
router resubmits the lost ones; a structured output's grammar resumes where it stopped, so its
JSON still parses), and the test ends once the rebuilt replica serves again, so the server's later
users find it as it was."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests import harness
from tests.structured import LONG_ORDER, json_completion

pytestmark = pytest.mark.engine  # the shared two-replica `dlora serve` process

MAX_TOKENS = 400  # long enough that no stream ends before every stream is under way
TEXT_JOBS = [(m, p) for m in ("tiny-base", "a0", "a1", "a2") for p in ("def main(", "for i in range(")]
# JSON-schema answers of a few hundred tokens that end by themselves (finish_reason "stop")
JSON_JOBS = [("a1", "import os"), ("tiny-base", "import os")]
JSON_MAX_TOKENS = 500  # within the 512-token context
JOBS = TEXT_JOBS + JSON_JOBS


def body_of(model: str, prompt: str) -> dict:
    if (model, prompt) in JSON_JOBS:
        return json_completion(model, prompt, LONG_ORDER, JSON_MAX_TOKENS)
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def replica_pids(server_pid: int) -> list[int]:
    """This server's ReplicaActor worker processes (Ray titles them `ray::ReplicaActor...`): found
    below the server's own process, so other servers on the machine are never touched."""
    tree, found, todo = _children(), [], [server_pid]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmdline.startswith("ray::ReplicaActor"):
            found.append(pid)
    return sorted(found)


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, progress: dict) -> list[int]:
    """The streamed token ids (return_token_ids), checked to end with one finish and [DONE]: at
    max_tokens for free text, at the end of its JSON value (which fits its schema) for a JSON job."""
    body = body_of(model, prompt) | {"return_token_ids": True, "stream": True}
    ids: list[int] = []
    text: list[str] = []
    events: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: ") :])
            if events[-1] != "[DONE]":
                chunk = json.loads(events[-1])
                assert "error" not in chunk, chunk
                ids.extend(chunk["choices"][0]["token_ids"])
                text.append(chunk["choices"][0]["text"])
                progress[(model, prompt)] = len(ids)
    finish = json.loads(events[-2])["choices"][0]["finish_reason"]
    assert events[-1] == "[DONE]"
    if (model, prompt) in JSON_JOBS:
        assert finish == "stop", len(ids)
        jsonschema.validate(json.loads("".join(text)), LONG_ORDER)
    else:
        assert finish == "length" and len(ids) == MAX_TOKENS
    return ids


def resubmissions(url: str) -> float:
    return harness.metric(url, "dlora_request_resubmissions_total")


async def routed(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Requests the router has on each replica now, by replica id."""
    text = (await client.get(f"{url}/metrics")).text
    return {
        line.split('replica="', 1)[1].split('"', 1)[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("dlora_replica_routed_requests{")
    }


def test_sigkilled_replica_process_loses_no_token(two_replica_server):
    url = two_replica_server.url
    pids = replica_pids(two_replica_server.proc.pid)
    assert len(pids) == 2, pids

    at_kill: dict[str, float] = {}

    async def run(kill: bool) -> list[list[int]]:
        nonlocal at_kill
        progress: dict = {}
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = [asyncio.create_task(stream(c, url, m, p, progress)) for m, p in JOBS]
            if kill:
                # Kill once half the streams are under way and both replicas carry some (which pid
                # is which replica is not known here, so both must hold streams for the kill to hit
                # any). Not every stream: with two LoRA slots a replica holding three adapters keeps
                # one adapter's streams queued until another adapter's finish.
                while True:
                    assert not any(t.done() for t in tasks), f"a stream ended before the kill: {at_kill}"
                    at_kill = await routed(c, url)
                    if len(progress) >= len(JOBS) // 2 and len(at_kill) == 2 and min(at_kill.values()) > 0:
                        break
                    await asyncio.sleep(0.05)
                os.kill(pids[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    reference = asyncio.run(run(kill=False))
    before = resubmissions(url)
    t0 = time.monotonic()
    disturbed = asyncio.run(run(kill=True))
    for (model, prompt), got, want in zip(JOBS, disturbed, reference):
        assert got == want, (model, prompt)  # no token lost, repeated or changed
    # the kill did hit streams, which moved to the other replica
    assert resubmissions(url) > before, f"routed requests at the kill: {at_kill}"
    assert time.monotonic() - t0 < 240
    serving_again(url)


def serving_again(url: str) -> None:
    """Wait until both replicas serve (the killed one is rebuilt) and the balancer has read their
    stats twice since, so that the measurements of the disturbed run are in /metrics."""
    deadline = time.monotonic() + 300
    while httpx.get(f"{url}/health", timeout=30).json().get("replicas_healthy") != 2:
        assert time.monotonic() < deadline, "the killed replica was not rebuilt"
        time.sleep(0.5)
    harness.wait_for_fresh_stats(url)

"""/v1/files and /v1/batches through the official `openai` client, on the real app and router over
simulated replicas (ToyReplica: deterministic tokens, no engine): the life cycle, per-line errors,
cancel, expiry, a restart that resumes without redoing finished lines, batch work yielding to
online requests, and API errors. The same on a real engine: tests/server/test_batch_engine.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from dlora.app.asgi import _refresh_gauges, attach, create_app
from dlora.app.state import build_state
from dlora.batch.store import BatchRecord, BatchStore
from dlora.config import from_dict
from dlora.sim.toy_replica import ToyReplica
from tests import harness

CMPL = "/v1/completions"


@dataclass
class CountingReplica(ToyReplica):
    """A toy replica that counts the requests it was given."""

    requests_seen: int = 0

    def generate(self, req):
        self.requests_seen += 1
        return super().generate(req)


@dataclass
class SlowToReturnReplica(CountingReplica):
    """A counting toy replica whose rebuild after `kill()` waits until `back` is set."""

    back: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        if self.started:  # the first start is the server's own
            await self.back.wait()
        await super().start()


@contextlib.asynccontextmanager
async def toy_server(
    tiny_model,
    state_dir,
    step_s: float = 0.002,
    max_in_flight: int | None = None,
    replica_type: type[CountingReplica] = CountingReplica,
    **overrides,
):
    """The app over one counting toy replica taking `step_s` a token; `batch.max_in_flight` set."""
    raw = harness.tiny_config(tiny_model, state_dir, 0)
    raw["batch"] = {} if max_in_flight is None else {"max_in_flight": max_in_flight}
    cfg = from_dict(harness.apply_overrides(raw, overrides))
    replica = replica_type(0, step_s=step_s)
    state = await build_state(cfg, replicas=[replica])

    async def make_state():
        return state

    app = create_app(make_state)
    attach(app, state)  # what the lifespan does; ASGITransport does not run it
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dlora")
    client = openai.AsyncOpenAI(base_url="http://dlora/v1", api_key="none", http_client=http, max_retries=0)
    try:
        yield client, state, replica
    finally:
        await state.close()
        await http.aclose()


def metric_values(state) -> dict[str, float]:
    """What GET /metrics would answer now, as {'name{labels}': value}."""
    _refresh_gauges(state)
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in state.metrics.render().decode().splitlines()
        if line and not line.startswith("#")
    }


def request_line(custom_id: str, model: str, prompt: str, max_tokens: int = 4, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CMPL,
        "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body},
    }


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


async def submit(client, lines: list, **kw):
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return await client.batches.create(input_file_id=f.id, endpoint=CMPL, completion_window="24h", **kw)


async def until(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        b = await client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        if time.monotonic() > deadline:
            for t in asyncio.all_tasks():
                t.print_stack(limit=4)
        assert time.monotonic() < deadline, f"batch stuck at {b.status}: {b}"
        await asyncio.sleep(0.05)


async def file_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines()]


def test_a_batch_runs_to_completion_and_each_output_equals_the_same_request_sent_online(tiny_model, tmp_path):
    lines = [
        request_line("r0", "tiny-base", "hello there"),
        request_line("r1", "a0", "hello there"),
        request_line("r2", "a1", "a longer prompt about ships", max_tokens=6),
        request_line("r3", "a0", "hello there", n=2, seed=3, temperature=0.5),
    ]

    async def run():
        async with toy_server(tiny_model, tmp_path / "state") as (client, state, _):
            batch = await submit(client, lines, metadata={"job": "eval"})
            assert (batch.object, batch.endpoint, batch.metadata) == ("batch", CMPL, {"job": "eval"})
            done = await until(client, batch.id, ("completed",))
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 4, 0)
            assert done.error_file_id is None and done.completed_at >= done.in_progress_at >= done.created_at
            out = await file_lines(client, done.output_file_id)
            assert [o["custom_id"] for o in out] == ["r0", "r1", "r2", "r3"]
            for o, line in zip(out, lines):
                assert o["error"] is None and o["response"]["status_code"] == 200
                online = (await client.completions.create(**line["body"])).model_dump(exclude_none=True)
                got = o["response"]["body"]
                assert [c["text"] for c in got["choices"]] == [c["text"] for c in online["choices"]]
                # vLLM's bodies carry unset fields as null; the client's dump leaves them out
                assert {k: v for k, v in got["usage"].items() if v is not None} == online["usage"]
                assert got["model"] == line["body"]["model"]
            meta = await client.files.retrieve(done.output_file_id)
            assert (meta.purpose, meta.filename) == ("batch_output", f"{batch.id}_output.jsonl")
            listed = await client.batches.list(limit=10)
            assert [b.id for b in listed.data] == [batch.id]
            scraped = metric_values(state)
            assert scraped['dlora_batches{status="completed"}'] == 1.0
            assert scraped['dlora_batches{status="in_progress"}'] == 0.0
            assert scraped['dlora_batch_requests_total{outcome="completed"}'] == 4.0
            assert scraped["dlora_batch_in_flight"] == 0.0

    asyncio.run(run())


def test_bad_lines_are_per_line_errors_and_the_rest_of_the_batch_runs(tiny_model, tmp_path):
    lines = [
        "{not json",
        {"method": "POST", "url": CMPL, "body": {"model": "a0", "prompt": "x"}},
        request_line("wrong-url", "a0", "x") | {"url": "/v1/chat/completions"},
        request_line("no-such-model", "nobody", "x"),
        request_line("bad-max-tokens", "a0", "x", max_tokens=-3),
        request_line("streamed", "a0", "x", stream=True),
        request_line("too-wide", "a0", "x", n=300),
        request_line("good", "a0", "x"),
        request_line("good", "a1", "x"),
    ]

    async def run():
        async with toy_server(tiny_model, tmp_path / "state") as (client, _, _):
            batch = await submit(client, lines)
            done = await until(client, batch.id, ("completed",))
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 1, 8)
            [ok] = await file_lines(client, done.output_file_id)
            assert ok["custom_id"] == "good" and ok["response"]["body"]["model"] == "a0"
            errors = await file_lines(client, done.error_file_id)
            by_id = {e["custom_id"]: e for e in errors}
            assert [e["error"]["line"] for e in errors if e["custom_id"] is None] == [1, 2]
            assert by_id["wrong-url"]["error"]["code"] == "unsupported_url"
            assert by_id["no-such-model"]["response"]["status_code"] == 404
            assert by_id["no-such-model"]["response"]["body"]["error"]["param"] == "model"
            assert by_id["bad-max-tokens"]["response"]["status_code"] == 400
            assert "max_tokens" in by_id["bad-max-tokens"]["error"]["message"]
            assert "cannot be streamed" in by_id["streamed"]["error"]["message"]
            assert by_id["too-wide"]["response"]["body"]["error"]["param"] == "n"
            assert by_id["good"]["error"]["code"] == "duplicate_custom_id"

    asyncio.run(run())


def test_cancel_stops_the_batch_aborts_its_running_requests_and_keeps_what_finished(tiny_model, tmp_path):
    lines = [request_line(f"r{i}", "a0", f"prompt {i}", max_tokens=40) for i in range(30)]

    async def run():
        async with toy_server(tiny_model, tmp_path / "state", step_s=0.02, max_in_flight=2) as (
            client,
            state,
            _,
        ):
            batch = await submit(client, lines)
            await until(client, batch.id, ("in_progress",))
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 2:
                await asyncio.sleep(0.05)
            cancelling = await client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            done = await until(client, batch.id, ("cancelled",), timeout=5)
            assert 2 <= done.request_counts.completed < 30 and done.cancelled_at is not None
            assert not state.router.requests, "a cancelled batch left requests in the cluster"
            out = await file_lines(client, done.output_file_id)
            assert len(out) == done.request_counts.completed
            with pytest.raises(openai.ConflictError):
                ok = await submit(client, lines[:1])
                await until(client, ok.id, ("completed",))
                await client.batches.cancel(ok.id)

    asyncio.run(run())


def test_an_expired_batch_reports_the_lines_it_never_ran(tiny_model, tmp_path):
    lines = [request_line(f"r{i}", "a0", f"prompt {i}", max_tokens=30) for i in range(20)]

    async def run():
        async with toy_server(tiny_model, tmp_path / "state", step_s=0.02, max_in_flight=1) as (
            client,
            state,
            _,
        ):
            batch = await submit(client, lines)
            await until(client, batch.id, ("in_progress",))
            state.batches.records[batch.id].expires_at = int(time.time())  # its window ends now
            done = await until(client, batch.id, ("expired",), timeout=10)
            counts = done.request_counts
            assert counts.completed + counts.failed == 20 and counts.failed > 0
            errors = await file_lines(client, done.error_file_id)
            assert len(errors) == counts.failed and {e["error"]["code"] for e in errors} == {"batch_expired"}

    asyncio.run(run())


def test_a_restart_resumes_the_batch_without_redoing_finished_lines(tiny_model, tmp_path):
    """Hostile lines among them are their own errors, once, across the restart; a record an older
    server stored with metadata no response can carry does not break the listing."""
    lines = [request_line(f"r{i}", "a0", f"prompt {i}", max_tokens=20) for i in range(12)]
    hostile = [
        request_line("surrogate", "a0", "\ud800"),  # escaped in the file's JSON, as a client must send it
        request_line("huge-n", "a0", "x", n=10**19),
    ]
    state_dir = tmp_path / "state"

    async def first_run() -> tuple[str, int]:
        async with toy_server(tiny_model, state_dir, step_s=0.02, max_in_flight=2) as (client, state, _):
            batch = await submit(client, hostile[:1] + lines[:6] + hostile[1:] + lines[6:])
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 4:
                await asyncio.sleep(0.02)
        # the server stopped here, mid-batch
        return batch.id, len(state.batches.store.results(batch.id))

    def plant_poisoned_record() -> str:
        old = BatchRecord.new(CMPL, "file-" + "0" * 24, "24h", 86400, {"k": "\ud800"})
        old.enter("completed")
        BatchStore(state_dir / "batches").save(old)
        return old.id

    async def second_run(batch_id: str, finished_before: int, poisoned_id: str):
        async with toy_server(tiny_model, state_dir, step_s=0.002) as (client, _, replica):
            done = await until(client, batch_id, ("completed",))
            assert (done.request_counts.completed, done.request_counts.failed) == (12, 2)
            assert replica.requests_seen == 12 - (finished_before - 2)
            out = await file_lines(client, done.output_file_id)
            assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(12)]
            for o, line in zip(out, lines):
                online = await client.completions.create(**line["body"])
                assert o["response"]["body"]["choices"][0]["text"] == online.choices[0].text
            errors = await file_lines(client, done.error_file_id)
            assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [
                ("surrogate", 400),
                ("huge-n", 400),
            ]
            listed = {b.id: b for b in (await client.batches.list()).data}
            assert listed.keys() == {batch_id, poisoned_id} and listed[poisoned_id].metadata is None

    batch_id, finished_before = asyncio.run(first_run())
    assert 4 + 2 <= finished_before < 12 + 2
    poisoned_id = plant_poisoned_record()
    asyncio.run(second_run(batch_id, finished_before, poisoned_id))


def test_lines_wait_out_a_cluster_with_no_replica_up_and_then_finish(tiny_model, tmp_path):
    lines = [request_line(f"r{i}", "a0", f"prompt {i}", max_tokens=20) for i in range(8)]

    async def run():
        async with toy_server(
            tiny_model, tmp_path / "state", step_s=0.02, max_in_flight=4, replica_type=SlowToReturnReplica
        ) as (client, state, replica):
            batch = await submit(client, lines)
            while (await client.batches.retrieve(batch.id)).request_counts.completed < 2:
                await asyncio.sleep(0.02)
            replica.kill()
            # The lines in flight fail over, find no replica up and, past the router's grace, are
            # answered 503 (an online client would get it); batch lines wait for the replica.
            await asyncio.sleep(state.router.cfg.recovery_grace_s + 2)
            assert not state.router.serving_ids()
            assert (await client.batches.retrieve(batch.id)).request_counts.failed == 0
            replica.back.set()
            done = await until(client, batch.id, ("completed",), timeout=60)
            assert (done.request_counts.completed, done.request_counts.failed) == (8, 0)
            assert replica.started == 2
            out = await file_lines(client, done.output_file_id)
            for o, line in zip(out, lines):
                online = await client.completions.create(**line["body"])
                assert o["response"]["body"]["choices"][0]["text"] == online.choices[0].text

    asyncio.run(run())


def test_batch_work_yields_its_places_to_online_requests(tiny_model, tmp_path):
    lines = [request_line(f"r{i}", "a0", f"prompt {i}", max_tokens=5) for i in range(40)]

    async def run():
        async with toy_server(tiny_model, tmp_path / "state", step_s=0.01, max_in_flight=4) as (
            client,
            state,
            _,
        ):
            batch = await submit(client, lines)
            await until(client, batch.id, ("in_progress",))
            online = [
                asyncio.ensure_future(client.completions.create(model="a1", prompt=f"online {i}", max_tokens=200))
                for i in range(3)
            ]
            all_online_since = None
            batch_in_flight = []  # sampled once the batch requests started before the online ones are done
            while not all(o.done() for o in online):
                reqs = [st.request for st in state.router.requests.values()]
                n_online = sum(1 for r in reqs if r.priority == 0)
                if n_online == 3:
                    all_online_since = all_online_since or time.monotonic()
                    if time.monotonic() - all_online_since > 0.5:
                        batch_in_flight.append(len(reqs) - n_online)
                await asyncio.sleep(0.01)
            await asyncio.gather(*online)
            # With 3 online requests in flight, one of the batch's 4 places stays open.
            assert batch_in_flight and max(batch_in_flight) <= 1
            done = await until(client, batch.id, ("completed",))
            assert done.request_counts.completed == 40

    asyncio.run(run())


def test_api_errors_are_openai_shaped(tiny_model, tmp_path):
    async def run():
        async with toy_server(tiny_model, tmp_path / "state", **{"batch.max_file_mib": 0.01}) as (client, _, _):
            with pytest.raises(openai.NotFoundError):
                await client.batches.retrieve("batch_" + "0" * 32)
            with pytest.raises(openai.NotFoundError):
                await client.files.retrieve("../../etc/passwd")
            with pytest.raises(openai.NotFoundError):
                await client.batches.create(input_file_id="file-" + "0" * 24, endpoint=CMPL, completion_window="24h")
            with pytest.raises(openai.BadRequestError, match="purpose"):
                await client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
            with pytest.raises(openai.APIStatusError) as too_big:
                await client.files.create(file=("x.jsonl", b"x" * 200_000), purpose="batch")
            assert too_big.value.status_code == 413 and "batch.max_file_mib" in too_big.value.message
            f = await client.files.create(file=("x.jsonl", jsonl([request_line("a", "a0", "x")])), purpose="batch")
            with pytest.raises(openai.BadRequestError, match="endpoint"):
                await client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
            with pytest.raises(openai.BadRequestError, match="completion_window"):
                await client.batches.create(input_file_id=f.id, endpoint=CMPL, completion_window="forever")
            with pytest.raises(openai.BadRequestError, match="metadata"):
                await client.batches.create(
                    input_file_id=f.id, endpoint=CMPL, completion_window="24h", metadata={"k": "v" * 600}
                )

    asyncio.run(run())


def test_an_input_file_over_the_request_limit_fails_the_batch_as_a_whole(tiny_model, tmp_path):
    async def run():
        async with toy_server(tiny_model, tmp_path / "state", **{"batch.max_requests": 2}) as (client, _, _):
            batch = await submit(client, [request_line(f"r{i}", "a0", "x") for i in range(3)])
            failed = await until(client, batch.id, ("failed",))
            assert failed.errors.data[0].code == "too_many_requests"
            assert "batch.max_requests" in failed.errors.data[0].message
            assert failed.output_file_id is None and failed.failed_at is not None

    asyncio.run(run())

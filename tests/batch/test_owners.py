"""Files and batches kept apart per API key, as OpenAI keeps organisations apart, through the official
`openai` client on the real app over toy replicas: another key's object is a 404 exactly as a
missing one and is never listed; the admin token sees every owner's, records stored before owners
included; quotas per owner refuse with 429 at their boundary and allow again after a delete; an
upload's `expires_after` sets its `expires_at` and the reaper removes what is due (never the input
of a running batch); DELETE /v1/batches/{id} removes an ended batch and refuses a running one.
The decisions themselves, without a server: test_retention.py."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from dlora.batch.files import FileStore
from dlora.batch.store import BatchRecord, BatchStore
from tests.batch.test_batch_api import CMPL, jsonl, request_line, submit, toy_server, until

KEY_A, KEY_B, ADMIN = "sk-tenant-a", "sk-tenant-b", "admin-secret"
DAY = 86400
MISSING_FILE, MISSING_BATCH = "file-" + "0" * 24, "batch_" + "0" * 32
ONE_LINE = jsonl([request_line("r0", "a0", "hello")])


async def assert_missing(call, object_id: str, kind: str, param: str) -> None:
    """The call is refused as one naming an object that does not exist: 404, the same body."""
    with pytest.raises(openai.NotFoundError) as refused:
        await call
    message = f"No such {kind}: {object_id!r}"
    assert refused.value.body == {"message": message, "type": "NotFoundError", "param": param, "code": 404}


async def delete_batch(client, batch_id: str) -> dict:
    return await client.delete(f"/batches/{batch_id}", cast_to=object)


def plant_records_without_owner(state_dir) -> tuple[str, str]:
    """A file and an ended batch as a server stored them before owners and expiries existed."""
    old = FileStore(state_dir / "files").create(ONE_LINE, "old.jsonl", "batch")
    path = state_dir / "files" / f"{old.id}.json"
    stored = json.loads(path.read_text())
    del stored["owner"], stored["expires_at"]
    path.write_text(json.dumps(stored))
    batch = BatchRecord.new(CMPL, old.id, "24h", DAY, None)
    batch.enter("completed")
    BatchStore(state_dir / "batches").save(batch)
    path = state_dir / "batches" / batch.id / "batch.json"
    stored = json.loads(path.read_text())
    del stored["owner"]
    path.write_text(json.dumps(stored))
    return old.id, batch.id


async def check_b_sees_nothing_of_as(b, file_ids: list[str], batch_id: str) -> None:
    for file_id in [*file_ids, MISSING_FILE]:
        await assert_missing(b.files.retrieve(file_id), file_id, "file", "file_id")
        await assert_missing(b.files.content(file_id), file_id, "file", "file_id")
        await assert_missing(b.files.delete(file_id), file_id, "file", "file_id")
        create = b.batches.create(input_file_id=file_id, endpoint=CMPL, completion_window="24h")
        await assert_missing(create, file_id, "file", "input_file_id")
    for bid in (batch_id, MISSING_BATCH):
        await assert_missing(b.batches.retrieve(bid), bid, "batch", "batch_id")
        await assert_missing(b.batches.cancel(bid), bid, "batch", "batch_id")
        await assert_missing(delete_batch(b, bid), bid, "batch", "batch_id")
        await assert_missing(b.batches.list(after=bid), bid, "batch", "after")


def test_each_key_sees_only_its_own_files_and_batches_and_the_admin_sees_every_owners(tiny_model, tmp_path):
    state_dir = tmp_path / "state"
    old_file, old_batch = plant_records_without_owner(state_dir)
    keys = {"server.api_key": [KEY_A, KEY_B], "server.admin_token": ADMIN}

    async def run():
        async with toy_server(tiny_model, state_dir, max_in_flight=1, **keys) as (anonymous, state, _):
            a, b, admin = (anonymous.with_options(api_key=k) for k in (KEY_A, KEY_B, ADMIN))
            with pytest.raises(openai.AuthenticationError):
                await anonymous.files.list()
            fa = await a.files.create(file=("a.jsonl", ONE_LINE), purpose="batch")
            assert fa.expires_at == fa.created_at + 30 * DAY  # batch.retention_days
            ba = await until(a, (await submit(a, [request_line("r0", "a0", "x")])).id, ("completed",))
            fb = await b.files.create(file=("b.jsonl", ONE_LINE), purpose="batch")
            a_files = {fa.id, ba.input_file_id, ba.output_file_id}

            await check_b_sees_nothing_of_as(b, sorted(a_files), ba.id)
            assert [f.id for f in (await b.files.list()).data] == [fb.id]
            assert (await b.batches.list()).data == []
            assert {f.id for f in (await a.files.list()).data} == a_files
            assert [x.id for x in (await a.batches.list()).data] == [ba.id]
            assert (await b.files.content(fb.id)).content == ONE_LINE  # B's own are B's
            # the admin: every owner's, those stored before owners too (no key reaches those)
            assert {f.id for f in (await admin.files.list()).data} == a_files | {fb.id, old_file}
            assert {x.id for x in (await admin.batches.list()).data} == {ba.id, old_batch}
            assert (await admin.files.retrieve(old_file)).expires_at is None
            assert (await admin.files.content(fa.id)).content == ONE_LINE
            await assert_missing(a.batches.retrieve(old_batch), old_batch, "batch", "batch_id")
            # the admin's batch of B's file is B's, as are its results
            for_b = await admin.batches.create(input_file_id=fb.id, endpoint=CMPL, completion_window="24h")
            for_b = await until(b, for_b.id, ("completed",))
            assert (await b.files.retrieve(for_b.output_file_id)).purpose == "batch_output"
            await assert_missing(a.batches.retrieve(for_b.id), for_b.id, "batch", "batch_id")

            # DELETE /v1/batches/{id}: a running batch is a 409, an ended one goes, its output file stays
            slow = await submit(a, [request_line(f"s{i}", "a0", "x", max_tokens=200) for i in range(5)])
            with pytest.raises(openai.ConflictError, match="cancel it first"):
                await delete_batch(a, slow.id)
            assert await delete_batch(a, ba.id) == {"id": ba.id, "object": "batch", "deleted": True}
            await assert_missing(a.batches.retrieve(ba.id), ba.id, "batch", "batch_id")
            assert not (state_dir / "batches" / ba.id).exists()
            assert (await a.files.retrieve(ba.output_file_id)).purpose == "batch_output"

            # an upload's expires_after, and the reaper at a later `now`
            with pytest.raises(openai.BadRequestError) as refused:
                await a.files.create(
                    file=("x.jsonl", ONE_LINE), purpose="batch", expires_after={"anchor": "created_at", "seconds": 60}
                )
            assert refused.value.body["param"] == "expires_after[seconds]"
            hour = {"anchor": "created_at", "seconds": 3600}
            long_line = jsonl([request_line("long", "a0", "x", max_tokens=200)])  # behind `slow`'s, one at a time
            short = await a.files.create(file=("short.jsonl", long_line), purpose="batch", expires_after=hour)
            assert short.expires_at == short.created_at + 3600
            reading = await a.batches.create(input_file_id=short.id, endpoint=CMPL, completion_window="24h")
            await state.batches.reap(now=short.created_at + 3600)
            assert (await a.batches.retrieve(reading.id)).status in ("validating", "in_progress")
            assert (await a.files.retrieve(short.id)).id == short.id  # a running batch's input stays
            for batch_id in (slow.id, reading.id):
                await a.batches.cancel(batch_id)
                await until(a, batch_id, ("cancelled",))
            await state.batches.reap(now=short.created_at + 3600)
            await assert_missing(a.files.retrieve(short.id), short.id, "file", "file_id")
            assert fa.id in {f.id for f in (await a.files.list()).data}

            await state.batches.reap(now=time.time() + 31 * DAY)
            assert (await a.files.list()).data == [] and (await a.batches.list()).data == []
            assert [f.id for f in (await admin.files.list()).data] == [old_file]  # stored without expiry
            assert (await admin.batches.list()).data == []

    asyncio.run(run())


def test_quotas_refuse_each_owner_at_its_boundary_and_allow_again_after_a_delete(tiny_model, tmp_path):
    limits = {
        "server.api_key": [KEY_A, KEY_B],
        "batch.max_files_per_owner": 2,
        "batch.max_batches_per_owner": 1,
        "batch.max_stored_mib_per_owner": 0.001,  # 1048 bytes
    }

    async def run():
        async with toy_server(tiny_model, tmp_path / "state", **limits) as (anonymous, _, _):
            a, b = (anonymous.with_options(api_key=k) for k in (KEY_A, KEY_B))
            f1 = await a.files.create(file=("1.jsonl", ONE_LINE), purpose="batch")
            f2 = await a.files.create(file=("2.jsonl", ONE_LINE), purpose="batch")
            with pytest.raises(openai.RateLimitError, match="batch.max_files_per_owner") as refused:
                await a.files.create(file=("3.jsonl", ONE_LINE), purpose="batch")
            assert refused.value.body["type"] == "TooManyRequestsError" and refused.value.status_code == 429
            full = await b.files.create(file=("full.jsonl", b"x" * 1048), purpose="batch")  # per owner
            with pytest.raises(openai.RateLimitError, match="batch.max_stored_mib_per_owner"):
                await b.files.create(file=("byte.jsonl", b"x"), purpose="batch")
            await b.files.delete(full.id)
            await b.files.create(file=("byte.jsonl", b"x"), purpose="batch")
            await a.files.delete(f2.id)
            await a.files.create(file=("2.jsonl", ONE_LINE), purpose="batch")

            batch = await a.batches.create(input_file_id=f1.id, endpoint=CMPL, completion_window="24h")
            with pytest.raises(openai.RateLimitError, match="batch.max_batches_per_owner"):
                await a.batches.create(input_file_id=f1.id, endpoint=CMPL, completion_window="24h")
            done = await until(a, batch.id, ("completed",))
            # A keeps as many files as it may: its results are written all the same, and count
            assert (await a.files.content(done.output_file_id)).text.count("\n") == 1
            with pytest.raises(openai.RateLimitError, match="batch.max_files_per_owner"):
                await a.files.create(file=("3.jsonl", ONE_LINE), purpose="batch")
            await delete_batch(a, batch.id)
            await a.batches.create(input_file_id=f1.id, endpoint=CMPL, completion_window="24h")

    asyncio.run(run())

"""What is removed when (dlora/batch/retention.py), what an owner may still store
(dlora/batch/quota.py), how an upload's `expires_after` is read, and records stored before owners
and expiries: pure logic, no server. Through the API: test_owners.py."""

from __future__ import annotations

import json

import pytest

from dlora.batch.files import FileRecord, FileStore
from dlora.batch.quota import Held, Usage, batch_refusal, upload_refusal
from dlora.batch.retention import due
from dlora.batch.routes import keep_seconds
from dlora.batch.store import BatchRecord, BatchStore
from dlora.config import BatchConfig, ConfigError
from dlora.server.errors import APIError

DAY = 86400
CMPL = "/v1/completions"


def file(file_id: str, expires_at: int | None, owner: str = "key-a", size: int = 10) -> FileRecord:
    return FileRecord(file_id, size, 1000, "in.jsonl", "batch", expires_at, owner)


def batch(input_file_id: str, status: str, ended_at: int | None = None) -> BatchRecord:
    record = BatchRecord.new(CMPL, input_file_id, "24h", DAY, None, "key-a")
    record.status = status
    if ended_at is not None:
        record.times[f"{status}_at"] = ended_at
    return record


def test_a_file_goes_at_its_expiry_unless_a_running_batch_reads_it():
    files = [file("kept", None), file("later", 5000), file("now", 4000), file("old", 10), file("read", 10)]
    batches = [batch("read", "in_progress"), batch("old", "completed", 100)]
    assert due(files, batches, 4000, None).files == ["now", "old"]
    assert due(files, batches, 3999, None).files == ["old"]
    for status in ("validating", "in_progress", "finalizing", "cancelling"):
        assert "read" not in due(files, [batch("read", status)], 10**9, None).files
    for status in ("completed", "failed", "expired", "cancelled"):
        assert "read" in due(files, [batch("read", status, 0)], 10**9, None).files


def test_an_ended_batch_goes_retention_after_it_ended_and_a_running_one_never():
    ended = {s: batch("f", s, 1000) for s in ("completed", "failed", "expired", "cancelled")}
    running = [batch("f", s) for s in ("validating", "in_progress", "finalizing", "cancelling")]
    records = [*ended.values(), *running]
    assert due([], records, 1000 + DAY - 1, DAY).batches == []
    assert sorted(due([], records, 1000 + DAY, DAY).batches) == sorted(b.id for b in ended.values())
    assert due([], records, 10**12, None).batches == []  # retention_days: null keeps them
    lost = batch("f", "completed")  # a damaged record without its end time ends at its creation
    assert due([], [lost], lost.created_at + DAY, DAY).batches == [lost.id]


def test_an_owner_is_refused_at_its_quotas_and_no_sooner():
    cfg = BatchConfig(max_files_per_owner=3, max_stored_mib_per_owner=1.0, max_batches_per_owner=2)
    mib = 1024 * 1024
    assert upload_refusal(Held(files=2, bytes=mib - 10), 10, cfg) is None
    refused = upload_refusal(Held(files=3), 1, cfg)
    assert refused is not None and "batch.max_files_per_owner" in refused and "DELETE /v1/files" in refused
    refused = upload_refusal(Held(files=0, bytes=mib - 10), 11, cfg)
    assert refused is not None and "batch.max_stored_mib_per_owner" in refused and "expire" in refused
    assert batch_refusal(Held(batches=1), cfg) is None
    refused = batch_refusal(Held(batches=2), cfg)
    assert refused is not None and "batch.max_batches_per_owner" in refused and "DELETE /v1/batches" in refused


def test_usage_is_counted_per_owner_and_follows_removals():
    usage = Usage.of([file("f1", None, "a", 5), file("f2", None, "a", 7), file("f3", None, "b", 1)], [])
    usage.add_batch("a")
    assert usage.held("a") == Held(files=2, bytes=12, batches=1) and usage.held("b") == Held(1, 1, 0)
    usage.remove_file("a", 7)
    usage.remove_batch("a")
    assert usage.held("a") == Held(files=1, bytes=5, batches=0) and usage.held("nobody") == Held()


@pytest.mark.parametrize(
    "anchor, seconds, param",
    [
        ("created_at", "3599", "expires_after[seconds]"),
        ("created_at", "2592001", "expires_after[seconds]"),
        ("created_at", "-3600", "expires_after[seconds]"),
        ("created_at", "1e4", "expires_after[seconds]"),
        ("created_at", None, "expires_after[seconds]"),
        ("last_active_at", "3600", "expires_after[anchor]"),
        (None, "3600", "expires_after[anchor]"),
    ],
)
def test_an_expires_after_openai_would_refuse_is_a_400_naming_it(anchor, seconds, param):
    with pytest.raises(APIError) as refused:
        keep_seconds(anchor, seconds)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_an_expires_after_within_openais_bounds_is_kept():
    assert keep_seconds(None, None) is None
    assert keep_seconds("created_at", "3600") == 3600 and keep_seconds("created_at", "2592000") == 2592000


def test_the_config_refuses_quotas_and_retention_that_mean_nothing():
    assert BatchConfig().retention_s == 30 * DAY and BatchConfig(retention_days=None).retention_s is None
    for bad in (
        {"max_files_per_owner": 0},
        {"max_batches_per_owner": 0},
        {"max_stored_mib_per_owner": 0},
        {"max_stored_mib_per_owner": float("inf")},
        {"retention_days": 0},
        {"retention_days": float("nan")},
    ):
        key = next(iter(bad))
        with pytest.raises(ConfigError, match=f"batch.{key}"):
            BatchConfig(**bad)


def test_records_stored_before_owners_and_expiries_are_the_no_key_owners_and_never_expire(tmp_path):
    files, batches = FileStore(tmp_path / "files"), BatchStore(tmp_path / "batches")
    new = files.create(b"{}\n", "in.jsonl", "batch", "key-a", 3600)
    assert new.expires_at == new.created_at + 3600 and "owner" not in new.to_openai()
    old = files.create(b"{}\n", "old.jsonl", "batch")
    stored = json.loads((tmp_path / "files" / f"{old.id}.json").read_text())
    del stored["owner"], stored["expires_at"]
    (tmp_path / "files" / f"{old.id}.json").write_text(json.dumps(stored))
    damaged = files.create(b"{}\n", "bad.jsonl", "batch")
    (tmp_path / "files" / f"{damaged.id}.json").write_text(json.dumps({"id": damaged.id, "bytes": "3"}))
    assert {r.id: (r.owner, r.expires_at) for r in files.list()} == {
        new.id: ("key-a", new.expires_at),
        old.id: ("", None),
    }
    assert [r.id for r in files.list(owner="")] == [old.id] and files.list(owner="key-b") == []
    record = BatchRecord.new(CMPL, old.id, "24h", DAY, None)
    batches.save(record)
    stored = json.loads((tmp_path / "batches" / record.id / "batch.json").read_text())
    del stored["owner"]
    (tmp_path / "batches" / record.id / "batch.json").write_text(json.dumps(stored))
    assert [b.owner for b in batches.all()] == [""]
    batches.delete(record.id)
    assert batches.all() == []

"""The batch journal and files on disk: a torn journal entry is a line to run again; ids that are
not ours never become paths."""

from __future__ import annotations

import json

import pytest

from dlora.batch.files import FileNotFound, FileStore, clean_filename
from dlora.batch.store import BatchNotFound, BatchRecord, BatchStore


def test_the_journal_keeps_finished_lines_and_ignores_a_torn_last_entry(tmp_path):
    store = BatchStore(tmp_path)
    record = BatchRecord.new("/v1/completions", "file-" + "0" * 24, "24h", 86400, None)
    store.save(record)
    store.append_result(record.id, 1, {"custom_id": "a"})
    store.append_result(record.id, 3, {"custom_id": "c"})
    with open(tmp_path / record.id / "results.jsonl", "a") as f:
        f.write('{"line": 4, "output": {"cus')  # the process died mid-write
    assert store.results(record.id) == {1: {"custom_id": "a"}, 3: {"custom_id": "c"}}
    again = store.get(record.id)
    assert again.to_openai() == record.to_openai()


@pytest.mark.parametrize("bad", ["../../etc/passwd", "batch_xyz", "batch_" + "0" * 31, ""])
def test_a_batch_id_not_of_our_shape_is_not_found(tmp_path, bad):
    with pytest.raises(BatchNotFound):
        BatchStore(tmp_path).get(bad)


@pytest.mark.parametrize("bad", ["../secrets", "file-../../x", "file-" + "g" * 24, "file-" + "0" * 23])
def test_a_file_id_not_of_our_shape_is_not_found(tmp_path, bad):
    with pytest.raises(FileNotFound):
        FileStore(tmp_path).get(bad)


def test_files_round_trip_and_a_record_without_its_bytes_is_not_listed(tmp_path):
    files = FileStore(tmp_path)
    a = files.create(b'{"x": 1}\n', "../../in.jsonl", "batch")
    b = files.create(b"", "out.jsonl", "batch_output")
    assert a.filename == "in.jsonl" and files.read(a.id) == b'{"x": 1}\n'
    assert {r.id for r in files.list()} == {a.id, b.id}
    assert [r.id for r in files.list("batch")] == [a.id]
    (tmp_path / f"{b.id}.jsonl").unlink()
    assert [r.id for r in files.list()] == [a.id]
    files.delete(a.id)
    with pytest.raises(FileNotFound):
        files.get(a.id)


def test_filenames_are_shown_without_paths_or_control_characters():
    assert clean_filename("C:\\x\\y.jsonl") == "y.jsonl"
    assert clean_filename("a\x1b[31mb.jsonl") == "a[31mb.jsonl"
    assert clean_filename(None) == "upload.jsonl"
    assert len(clean_filename("x" * 1000)) == 255


def test_a_stored_record_with_metadata_openai_would_refuse_is_listed_without_it(tmp_path, caplog):
    """A record an older server saved (a lone surrogate in metadata cannot be encoded in any
    response) must not break the listing of every batch."""
    store = BatchStore(tmp_path)
    good = BatchRecord.new("/v1/completions", "file-" + "0" * 24, "24h", 86400, {"job": "eval"})
    poisoned = BatchRecord.new("/v1/completions", "file-" + "1" * 24, "24h", 86400, {"k": "\ud800"})
    damaged = BatchRecord.new("/v1/completions", "file-" + "2" * 24, "24h", 86400, None)
    damaged.endpoint = "/v1/\udc00"  # a field no response can carry: not listed at all
    for record in (good, poisoned, damaged):
        store.save(record)
    (tmp_path / ("batch_" + "f" * 32)).mkdir()
    (tmp_path / ("batch_" + "f" * 32) / "batch.json").write_text('{"id": 1, "unknown": 2}')
    listed = {r.id: r for r in store.all()}
    assert listed.keys() == {good.id, poisoned.id}
    assert listed[good.id].metadata == {"job": "eval"} and listed[poisoned.id].metadata is None
    for record in listed.values():
        json.dumps(record.to_openai(), ensure_ascii=False).encode()
    logged = caplog.text
    assert "stored metadata is not valid" in logged and "cannot be shown" in logged and "damaged" in logged

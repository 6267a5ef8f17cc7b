"""Finished lines reach the journal in groups: lines that finish together are one write and one
fsync, in a worker thread, never on the event loop; a stop writes every line; a failed write fails
the batch (it is raised at the stop)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dlora.batch.journal import Journal
from dlora.batch.store import BatchRecord, BatchStore


def test_lines_that_finish_together_are_one_write_off_the_event_loop():
    writes: list[tuple[int, list]] = []

    def write(group):
        writes.append((threading.get_ident(), list(group)))

    async def run() -> int:
        journal = Journal(write, every_s=0.05)
        for i in range(2500):
            journal.add(i, {"n": i})
        await asyncio.sleep(0.3)
        journal.add(2500, {"n": 2500})  # the stop writes what the interval has not yet
        await journal.close()
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert [len(group) for _, group in writes] == [2500, 1]
    assert [entry for _, group in writes for entry in group] == [(i, {"n": i}) for i in range(2501)]
    assert all(thread != loop_thread for thread, _ in writes)


def test_a_write_that_fails_is_raised_at_the_stop():
    def write(group):
        raise OSError("disk full")

    async def run():
        journal = Journal(write, every_s=0.01)
        journal.add(1, {})
        await asyncio.sleep(0.1)
        journal.add(2, {})
        await journal.close()

    with pytest.raises(OSError, match="disk full"):
        asyncio.run(run())


def test_a_group_is_one_fsync_and_every_entry_is_read_back(tmp_path, monkeypatch):
    store = BatchStore(tmp_path)
    record = BatchRecord.new("/v1/completions", "file-" + "0" * 24, "24h", 86400, None)
    store.save(record)
    synced = []
    monkeypatch.setattr("dlora.batch.store.os.fsync", synced.append)
    store.append_results(record.id, [(i, {"custom_id": f"c\u2028{i}"}) for i in range(1, 2501)])
    assert len(synced) == 1
    done = store.results(record.id)
    assert len(done) == 2500 and done[7] == {"custom_id": "c\u20287"}

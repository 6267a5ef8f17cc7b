"""The batches of one server: create, list, cancel, delete, expire, and resume after a restart.

Each active batch is one asyncio task running it from its input file to its outputs
(dlora/batch/batch_run.py). Statuses are OpenAI's: validating -> in_progress -> finalizing ->
completed, or failed (the input as a whole is unusable), cancelling -> cancelled, expired.

Files and batches belong to an owner (an API key, dlora/server/owners.py; None in a call: the
admin, every owner). Another owner's object is "not found", exactly as a missing one. Each owner's
stored files and batches are held to its quotas (dlora/batch/quota.py), and a reaper removes expired
files and long-ended batches (dlora/batch/retention.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

from dlora.batch.batch_run import BatchRun, RunShared
from dlora.batch.files import FileNotFound, FileRecord, FileStore
from dlora.batch.gate import BatchGate
from dlora.batch.lines import ENDPOINTS
from dlora.batch.metadata import checked_metadata
from dlora.batch.planned import BatchPlanner
from dlora.batch.quota import Usage, batch_refusal, upload_refusal
from dlora.batch.reading import LineRules
from dlora.batch.retention import due, expired
from dlora.batch.runner import Execute
from dlora.batch.store import ACTIVE, ENDED, BatchNotFound, BatchRecord, BatchStore, RecordSaver
from dlora.config import BatchConfig
from dlora.server.errors import APIError
from dlora.server.state import ServerState

log = logging.getLogger(__name__)

WINDOW = re.compile(r"([1-9][0-9]{0,3})h")  # OpenAI's "24h"; any whole number of hours up to 9999
REAP_EVERY_S = 60.0  # how often expired files and long-ended batches are looked for
ADMIN_OWNER = ""  # whose the files the admin uploads are: the owner of callers without an API key


class BatchService:
    def __init__(
        self,
        cfg: BatchConfig,
        files: FileStore,
        store: BatchStore,
        execute: Execute,
        gate: BatchGate,
        planner: BatchPlanner | None = None,
        rules: LineRules | None = None,
    ):
        self.cfg = cfg
        self.rules = rules or LineRules()
        self.files = files
        self.store = store
        self.execute = execute
        self.gate = gate
        self.planner = planner
        self.records: dict[str, BatchRecord] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancel: dict[str, asyncio.Event] = {}
        self.saver = RecordSaver(store)
        self._reaper: asyncio.Task | None = None
        self.usage = Usage()  # counted from the stores at start
        self.on_line: Callable[[str], None] = lambda outcome: None  # each finished line: completed | failed
        # What every batch run shares; usage and on_line are read when used (start() recounts usage,
        # the server sets on_line after building the service).
        self._shared = RunShared(
            cfg,
            files,
            store,
            self.saver,
            execute,
            gate,
            planner,
            self.rules,
            lambda owner, size: self.usage.add_file(owner, size),
            lambda outcome: self.on_line(outcome),
        )

    # ---- life cycle ----------------------------------------------------------------------------
    def counts_by_status(self) -> dict[str, int]:
        """Batches per status, every status named (zeros included): what /metrics shows."""
        counts = dict.fromkeys((*ACTIVE, *ENDED), 0)
        for record in self.records.values():
            counts[record.status] += 1
        return counts

    def start(self) -> None:
        """Load every stored batch, count what each owner keeps, resume the unfinished batches and
        start the reaper (in the running event loop)."""
        for record in reversed(self.store.all()):
            self.records[record.id] = record
            if record.status in ACTIVE:
                log.info("batch %s: resuming (%s)", record.id, record.status)
                self._spawn(record)
        self.usage = Usage.of(self.files.list(), self.records.values())
        self._reaper = asyncio.create_task(self._reap_every(REAP_EVERY_S), name="batch reaper")

    async def close(self) -> None:
        """Stop every batch where it is; its journal keeps what finished, a restart resumes it."""
        tasks = list(self._tasks.values()) + ([self._reaper] if self._reaper is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the API: files -------------------------------------------------------------------------
    async def upload(
        self, content: bytes, filename: str, purpose: str, owner: str | None, keep_s: int | None
    ) -> FileRecord:
        """Store an uploaded file for `owner` (the admin's: ADMIN_OWNER), kept `keep_s` seconds
        (None: `batch.retention_days`); 429 past the owner's quotas."""
        owner = ADMIN_OWNER if owner is None else owner
        refusal = upload_refusal(self.usage.held(owner), len(content), self.cfg)
        if refusal is not None:
            raise APIError(429, refusal)
        # Counted before the write, so that uploads written at the same time cannot pass the quota together.
        self.usage.add_file(owner, len(content))
        try:
            keep = self.cfg.retention_s if keep_s is None else keep_s
            return await asyncio.to_thread(self.files.create, content, filename, purpose, owner, keep)
        except BaseException:
            self.usage.remove_file(owner, len(content))
            raise

    def delete_file(self, file_id: str, owner: str | None) -> None:
        try:
            record = self.files.delete(file_id, owner)
        except FileNotFound:
            raise APIError(404, f"No such file: {file_id!r}", "file_id") from None
        self.usage.remove_file(record.owner, record.bytes)

    # ---- the API: batches -----------------------------------------------------------------------
    async def create(
        self, input_file_id: str, endpoint: str, completion_window: str, metadata: object, owner: str | None = None
    ) -> BatchRecord:
        """A batch of `owner`'s file (None: the admin, any owner's file; the batch is the file's
        owner's); 429 past that owner's batch quota."""
        if endpoint not in ENDPOINTS:
            why = f"endpoint {endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}"
            raise APIError(400, why, "endpoint")
        window = WINDOW.fullmatch(completion_window) if isinstance(completion_window, str) else None
        if window is None:
            why = f"completion_window {completion_window!r} must be a number of hours such as '24h'"
            raise APIError(400, why, "completion_window")
        tags = checked_metadata(metadata)
        try:
            source = self.files.get(input_file_id, owner)
        except FileNotFound:
            source = None
        # An expired file the reaper has not removed yet is gone already: no batch may start to read it.
        if source is None or expired(source, time.time()):
            raise APIError(404, f"No such file: {input_file_id!r}", "input_file_id")
        if source.purpose != "batch":
            raise APIError(400, f"file {input_file_id} has purpose {source.purpose!r}, not 'batch'", "input_file_id")
        refusal = batch_refusal(self.usage.held(source.owner), self.cfg)
        if refusal is not None:
            raise APIError(429, refusal)
        window_s = int(window.group(1)) * 3600
        record = BatchRecord.new(endpoint, input_file_id, completion_window, window_s, tags, source.owner)
        self.records[record.id] = record  # first: a second create meanwhile counts it against the quota
        self.usage.add_batch(record.owner)
        try:
            await self.saver.save(record)
        except BaseException:
            del self.records[record.id]
            self.usage.remove_batch(record.owner)
            raise
        self._spawn(record)
        return record

    def get(self, batch_id: str, owner: str | None = None) -> BatchRecord:
        """The batch, if `owner` may see it (None: any owner)."""
        record = self.records.get(batch_id)
        if record is None or (owner is not None and record.owner != owner):
            raise APIError(404, f"No such batch: {batch_id!r}", "batch_id")
        return record

    def page(self, after: str | None, limit: int, owner: str | None = None) -> tuple[list[BatchRecord], bool]:
        """`owner`'s batches (None: every owner's), newest first, from after the batch `after`
        (OpenAI's cursor); and whether more follow."""
        mine = [r for r in self.records.values() if owner is None or r.owner == owner]
        ordered = sorted(mine, key=lambda r: (-r.created_at, r.id))
        if after is not None:
            ids = [r.id for r in ordered]
            if after not in ids:
                raise APIError(404, f"No such batch: {after!r}", "after")
            ordered = ordered[ids.index(after) + 1 :]
        return ordered[:limit], len(ordered) > limit

    async def cancel(self, batch_id: str, owner: str | None = None) -> BatchRecord:
        record = self.get(batch_id, owner)
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status in ENDED:
            raise APIError(409, f"Cannot cancel a batch with status {record.status!r}", "batch_id")
        record.enter("cancelling")
        await self.saver.save(record)
        event = self._cancel.get(batch_id)
        if event is not None:
            event.set()
        return record

    def delete(self, batch_id: str, owner: str | None = None) -> None:
        """Remove an ended batch's record and journal (its output and error files stay); 409 while
        it runs."""
        record = self.get(batch_id, owner)
        if record.status in ACTIVE:
            why = f"batch {batch_id} is {record.status}: cancel it first (POST /v1/batches/{batch_id}/cancel)"
            raise APIError(409, why, "batch_id")
        self.store.delete(batch_id)
        self._forget(record)

    def _forget(self, record: BatchRecord) -> None:
        if self.records.pop(record.id, None) is not None:
            self.usage.remove_batch(record.owner)
        self._cancel.pop(record.id, None)

    # ---- retention ------------------------------------------------------------------------------
    async def _reap_every(self, period_s: float) -> None:
        while True:
            try:
                await self.reap()
            except Exception as e:  # a disk error: the next round tries again, the server goes on
                log.error("removing expired files and batches failed", exc_info=e)
            await asyncio.sleep(period_s)

    async def reap(self, now: float | None = None) -> None:
        """Remove the files and ended batches due at `now` (default: the clock)."""
        now = time.time() if now is None else now
        files = await asyncio.to_thread(self.files.list)
        # Decided on the event loop, against the batches as they are now: a batch made after this
        # cannot start from an expired file (`create`), so no input of a running batch is removed.
        chosen = due(files, self.records.values(), now, self.cfg.retention_s)
        batches = [self.records[b] for b in chosen.batches]
        for batch in batches:
            self._forget(batch)
        removed = await asyncio.to_thread(self._remove, chosen.files, [b.id for b in batches])
        for file in removed:
            self.usage.remove_file(file.owner, file.bytes)
        if removed or batches:
            log.info("removed %d expired files and %d ended batches", len(removed), len(batches))

    def _remove(self, file_ids: list[str], batch_ids: list[str]) -> list[FileRecord]:
        """Delete the batches and files (in a worker thread); the files it removed (one deleted
        meanwhile is not among them)."""
        for batch_id in batch_ids:
            try:
                self.store.delete(batch_id)
            except BatchNotFound:
                pass
        removed = []
        for file_id in file_ids:
            try:
                removed.append(self.files.delete(file_id))
            except FileNotFound:
                pass
        return removed

    # ---- running a batch -----------------------------------------------------------------------
    def _spawn(self, record: BatchRecord) -> None:
        cancelled = self._cancel[record.id] = asyncio.Event()
        if record.status == "cancelling":
            cancelled.set()
        task = asyncio.create_task(BatchRun(self._shared, record, cancelled).run(), name=f"batch {record.id}")
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))


def batch_service(state: ServerState) -> BatchService:
    """The batch service the app built on `state` (dlora.app.state)."""
    service = state.batches
    if not isinstance(service, BatchService):
        raise RuntimeError("this server state has no batch service")
    return service

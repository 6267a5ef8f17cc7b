"""The batches of one server: create, run, cancel, expire, and resume after a restart.

Each active batch is one asyncio task. It reads its input file as it streams from disk, in a
worker thread (dlora/batch/reading.py), turning every line into a request or that line's error: a
line its route would refuse (`LineRules`: the body-size cap, dlora's admission checks, vLLM's
request model) is that line's error before anything is planned. It runs the requests through the
shared `BatchGate` (batch work yields to online work) in the order its plan gives
(dlora/batch/planned.py), journaling finished lines in groups (dlora/batch/journal.py).
When every line is done (or the batch is cancelled or its window runs out) it writes the output
file (successful lines, in input order) and the error file (failed lines, and the lines an
expired batch never ran), and ends. Statuses are OpenAI's: validating -> in_progress ->
finalizing -> completed, or failed (the input as a whole is unusable),
cancelling -> cancelled, expired.

Files and batches belong to an owner (an API key, dlora/server/owners.py; None in a call: the
admin, every owner). Another owner's object is "not found", exactly as a missing one. Each owner's
stored files and batches are held to its quotas (dlora/batch/quota.py), and a reaper removes expired
files and long-ended batches (dlora/batch/retention.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict

from dlora.batch.files import FileNotFound, FileRecord, FileStore
from dlora.batch.gate import BatchGate
from dlora.batch.journal import Journal
from dlora.batch.lines import ENDPOINTS, BatchLine, LineError, error_output, is_error
from dlora.batch.metadata import checked_metadata
from dlora.batch.pacing import Pacer
from dlora.batch.planned import BatchPlanner, run_batch
from dlora.batch.quota import Usage, batch_refusal, upload_refusal
from dlora.batch.reading import LineRules, TooManyRequests, read_batch_file
from dlora.batch.retention import due, expired
from dlora.batch.runner import Execute
from dlora.batch.store import ACTIVE, ENDED, BatchNotFound, BatchRecord, BatchStore
from dlora.config import BatchConfig
from dlora.server.errors import APIError

log = logging.getLogger(__name__)

WINDOW = re.compile(r"([1-9][0-9]{0,3})h")  # OpenAI's "24h"; any whole number of hours up to 9999
# Lines handled between two chances for everything else to run (a few ms of work: a file of 50,000
# refused lines would otherwise hold every stream for about a second), paced (dlora/batch/pacing.py).
YIELD_EVERY = 256
SAVE_EVERY_S = 1.0  # how often a running batch's counts are written (the journal has every line anyway)
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
        self._saving = asyncio.Lock()  # record saves, one at a time in the order asked
        self._saves: set[asyncio.Task] = set()  # saves asked for by synchronous callers, under way
        self._reaper: asyncio.Task | None = None
        self.usage = Usage()  # counted from the stores at start
        self.on_line: Callable[[str], None] = lambda outcome: None  # each finished line: completed | failed

    # ---- life cycle ----------------------------------------------------------------------------
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
            await self._save(record)
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
        await self._save(record)
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
        self._cancel[record.id] = asyncio.Event()
        if record.status == "cancelling":
            self._cancel[record.id].set()
        task = asyncio.create_task(self._run(record), name=f"batch {record.id}")
        self._tasks[record.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(record.id, None))

    async def _run(self, record: BatchRecord) -> None:
        try:
            parsed = await self._validate(record)
            if parsed is None:
                return
            ending, done = await self._run_lines(record, parsed)
            await self._finalize(record, parsed, ending, done)
        except asyncio.CancelledError:
            self.store.save(record)  # counts as far as they went; the journal has every finished line
            raise
        except Exception as e:  # a disk error, a damaged journal: the batch fails, the server goes on
            log.error("batch %s failed", record.id, exc_info=e)
            await self._fail(record, "internal_error", f"the batch could not be processed: {type(e).__name__}")

    async def _validate(self, record: BatchRecord) -> list[BatchLine | LineError] | None:
        try:
            path = self.files.content_path(record.input_file_id)
            limit = self.cfg.max_requests
            pause = self._pacer().pause
            parsed = await asyncio.to_thread(read_batch_file, path, record.endpoint, limit, self.rules, pause)
        except (FileNotFound, FileNotFoundError):
            await self._fail(record, "file_not_found", f"the input file {record.input_file_id} no longer exists")
            return None
        except TooManyRequests as e:
            await self._fail(record, "too_many_requests", str(e))
            return None
        if not parsed:
            await self._fail(record, "empty_file", "the input file has no requests")
            return None
        record.request_counts.total = len(parsed)
        if record.status == "validating":
            record.enter("in_progress")
        await self._save(record)
        return parsed

    async def _run_lines(self, record: BatchRecord, parsed: list[BatchLine | LineError]) -> tuple[str, dict[int, dict]]:
        """Run every line not yet journaled; the status the batch ends with, and every finished
        line's output by line number (the journal's content). The counts follow each line."""
        done = await asyncio.to_thread(self.store.results, record.id)
        self._recount(record, done)
        journal = Journal(lambda group: self.store.append_results(record.id, group))
        try:
            pacer = self._pacer()
            for k, item in enumerate(parsed):
                if isinstance(item, LineError) and item.line not in done:
                    self._finish_line(record, done, journal, item.line, error_output(item))
                if k % YIELD_EVERY == YIELD_EVERY - 1:
                    await pacer.apause()
            todo = [item for item in parsed if isinstance(item, BatchLine) and item.line not in done]
            cancelled = self._cancel[record.id]

            def stopping() -> bool:
                return cancelled.is_set() or self._expired(record)

            def finished(line: BatchLine, output: dict) -> None:
                self._finish_line(record, done, journal, line.line, output)

            save = lambda: self._save_soon(record)  # noqa: E731
            await run_batch(todo, self.execute, self.gate, self.planner, finished, stopping, save, SAVE_EVERY_S)
        finally:
            await journal.close()
        if cancelled.is_set():
            return "cancelled", done
        return ("expired" if len(done) < len(parsed) else "completed"), done

    def _expired(self, record: BatchRecord) -> bool:
        return time.time() >= record.expires_at

    def _finish_line(
        self, record: BatchRecord, done: dict[int, dict], journal: Journal, line: int, output: dict
    ) -> None:
        journal.add(line, output)
        done[line] = output
        outcome = "failed" if is_error(output) else "completed"
        if outcome == "failed":
            record.request_counts.failed += 1
        else:
            record.request_counts.completed += 1
        self.on_line(outcome)

    @staticmethod
    def _recount(record: BatchRecord, done: dict[int, dict]) -> None:
        failed = sum(1 for out in done.values() if is_error(out))
        record.request_counts.completed, record.request_counts.failed = len(done) - failed, failed

    async def _finalize(
        self, record: BatchRecord, parsed: list[BatchLine | LineError], ending: str, done: dict[int, dict]
    ) -> None:
        if ending != "cancelled":
            record.enter("finalizing")
            await self._save(record)
        outputs: list[dict] = []
        errors: list[dict] = []
        pacer = self._pacer()
        for k, item in enumerate(parsed):
            if k % YIELD_EVERY == YIELD_EVERY - 1:
                await pacer.apause()
            output = done.get(item.line)
            if output is None and ending == "expired":
                why = "the batch expired before this request ran"
                output = error_output(LineError(item.line, item.custom_id, "batch_expired", why))
            if output is not None:
                (errors if is_error(output) else outputs).append(output)
        if outputs:
            record.output_file_id = await self._write_file(record, "output", outputs)
        if errors:
            record.error_file_id = await self._write_file(record, "error", errors)
        if ending == "expired":
            record.request_counts.failed += len(parsed) - len(done)
        record.enter(ending)
        await self._save(record)
        log.info("batch %s %s: %s", record.id, ending, record.request_counts)

    async def _write_file(self, record: BatchRecord, kind: str, lines: list[dict]) -> str:
        """The batch's owner's file (always written, even past the owner's quota: results are
        never lost; it counts)."""
        owner, keep = record.owner, self.cfg.retention_s

        pause = self._pacer().pause

        def write():  # encoding a large file takes a while: off the event loop too, and paced
            parts = []
            for k, line in enumerate(lines):
                parts.append(json.dumps(line) + "\n")
                if k % YIELD_EVERY == YIELD_EVERY - 1:
                    pause()
            content = "".join(parts).encode()
            return self.files.create(content, f"{record.id}_{kind}.jsonl", "batch_output", owner, keep)

        made = await asyncio.to_thread(write)
        self.usage.add_file(made.owner, made.bytes)
        return made.id

    async def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        record.errors = [{"code": code, "message": message, "param": None, "line": None}]
        record.enter("failed")
        await self._save(record)

    def _pacer(self) -> Pacer:
        """Bookkeeping that yields the API process to online requests while any are in flight."""
        return Pacer(lambda: self.gate.online_choices() > 0)

    async def _save(self, record: BatchRecord) -> None:
        """Store the record as it is now, in a worker thread: a flush to disk on the event loop would
        hold every stream for as long as the disk takes (after a large output file, a good part of a
        second). One save at a time, in the order asked, so an older state never lands last."""
        data = asdict(record)
        async with self._saving:
            await asyncio.to_thread(self.store.write, record.id, data)

    def _save_soon(self, record: BatchRecord) -> None:
        """`_save` from a synchronous caller (the counts a running batch writes now and then)."""
        task = asyncio.create_task(self._save(record))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

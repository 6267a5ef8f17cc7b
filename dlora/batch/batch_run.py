"""One batch from its input file to its output and error files.

It reads its input file as it streams from disk, in a worker thread (dlora/batch/reading.py), turning
every line into a request or that line's error: a line its route would refuse (`LineRules`: the
body-size cap, dlora's admission checks, vLLM's request model) is that line's error before anything
is planned. It runs the requests through the shared `BatchGate` (batch work yields to online work)
in the order its plan gives (dlora/batch/planned.py), journaling finished lines in groups
(dlora/batch/journal.py). When every line is done (or the batch is cancelled or its window runs
out) it writes the output file (successful lines, in input order) and the error file (failed lines,
and the lines an expired batch never ran). Bookkeeping over many lines yields to online requests
(dlora/batch/pacing.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlora.batch.files import FileNotFound, FileStore
from dlora.batch.gate import BatchGate
from dlora.batch.journal import Journal
from dlora.batch.lines import BatchLine, LineError, error_output, is_error
from dlora.batch.pacing import Pacer
from dlora.batch.planned import BatchPlanner, run_batch
from dlora.batch.reading import LineRules, TooManyRequests, read_batch_file
from dlora.batch.runner import Execute
from dlora.batch.store import BatchRecord, BatchStore, RecordSaver
from dlora.config import BatchConfig

log = logging.getLogger(__name__)

SAVE_EVERY_S = 1.0  # how often a running batch's counts are written (the journal has every line anyway)


@dataclass(frozen=True)
class RunShared:
    """What every batch run of a server shares."""

    cfg: BatchConfig
    files: FileStore
    store: BatchStore
    saver: RecordSaver
    execute: Execute
    gate: BatchGate
    planner: BatchPlanner | None
    rules: LineRules
    add_file: Callable[[str, int], None]  # an output file counted against its owner's quota
    on_line: Callable[[str], None]  # each finished line: completed | failed


class BatchRun:
    def __init__(self, shared: RunShared, record: BatchRecord, cancelled: asyncio.Event) -> None:
        self.shared = shared
        self.record = record
        self.cancelled = cancelled

    async def run(self) -> None:
        record = self.record
        try:
            parsed = await self._validate()
            if parsed is None:
                return
            ending, done = await self._run_lines(parsed)
            await self._finalize(parsed, ending, done)
        except asyncio.CancelledError:
            self.shared.store.save(record)  # counts as far as they went; the journal has every finished line
            raise
        except Exception as e:  # a disk error, a damaged journal: the batch fails, the server goes on
            log.error("batch %s failed", record.id, exc_info=e)
            await self._fail("internal_error", f"the batch could not be processed: {type(e).__name__}")

    async def _validate(self) -> list[BatchLine | LineError] | None:
        record, shared = self.record, self.shared
        try:
            path = shared.files.content_path(record.input_file_id)
            limit, step = shared.cfg.max_requests, self._pacer().step
            parsed = await asyncio.to_thread(read_batch_file, path, record.endpoint, limit, shared.rules, step)
        except (FileNotFound, FileNotFoundError):
            await self._fail("file_not_found", f"the input file {record.input_file_id} no longer exists")
            return None
        except TooManyRequests as e:
            await self._fail("too_many_requests", str(e))
            return None
        if not parsed:
            await self._fail("empty_file", "the input file has no requests")
            return None
        record.request_counts.total = len(parsed)
        if record.status == "validating":
            record.enter("in_progress")
        await shared.saver.save(record)
        return parsed

    async def _run_lines(self, parsed: list[BatchLine | LineError]) -> tuple[str, dict[int, dict]]:
        """Run every line not yet journaled; the status the batch ends with, and every finished
        line's output by line number (the journal's content). The counts follow each line."""
        record, shared = self.record, self.shared
        done = await asyncio.to_thread(shared.store.results, record.id)
        self._recount(done)
        journal = Journal(lambda group: shared.store.append_results(record.id, group))
        try:
            pacer = self._pacer()
            # A file of 50,000 refused lines would otherwise hold every stream for about a second.
            for item in parsed:
                if isinstance(item, LineError) and item.line not in done:
                    self._finish_line(done, journal, item.line, error_output(item))
                await pacer.astep()
            todo = [item for item in parsed if isinstance(item, BatchLine) and item.line not in done]

            def stopping() -> bool:
                return self.cancelled.is_set() or time.time() >= record.expires_at

            def finished(line: BatchLine, output: dict) -> None:
                self._finish_line(done, journal, line.line, output)

            save = lambda: shared.saver.save_soon(record)  # noqa: E731
            await run_batch(todo, shared.execute, shared.gate, shared.planner, finished, stopping, save, SAVE_EVERY_S)
        finally:
            await journal.close()
        if self.cancelled.is_set():
            return "cancelled", done
        return ("expired" if len(done) < len(parsed) else "completed"), done

    def _finish_line(self, done: dict[int, dict], journal: Journal, line: int, output: dict) -> None:
        journal.add(line, output)
        done[line] = output
        outcome = "failed" if is_error(output) else "completed"
        if outcome == "failed":
            self.record.request_counts.failed += 1
        else:
            self.record.request_counts.completed += 1
        self.shared.on_line(outcome)

    def _recount(self, done: dict[int, dict]) -> None:
        failed = sum(1 for out in done.values() if is_error(out))
        self.record.request_counts.completed, self.record.request_counts.failed = len(done) - failed, failed

    async def _finalize(self, parsed: list[BatchLine | LineError], ending: str, done: dict[int, dict]) -> None:
        record = self.record
        if ending != "cancelled":
            record.enter("finalizing")
            await self.shared.saver.save(record)
        outputs: list[dict] = []
        errors: list[dict] = []
        pacer = self._pacer()
        for item in parsed:
            await pacer.astep()
            output = done.get(item.line)
            if output is None and ending == "expired":
                why = "the batch expired before this request ran"
                output = error_output(LineError(item.line, item.custom_id, "batch_expired", why))
            if output is not None:
                (errors if is_error(output) else outputs).append(output)
        if outputs:
            record.output_file_id = await self._write_file("output", outputs)
        if errors:
            record.error_file_id = await self._write_file("error", errors)
        if ending == "expired":
            record.request_counts.failed += len(parsed) - len(done)
        record.enter(ending)
        await self.shared.saver.save(record)
        log.info("batch %s %s: %s", record.id, ending, record.request_counts)

    async def _write_file(self, kind: str, lines: list[dict]) -> str:
        """The batch's owner's file (always written, even past the owner's quota: results are
        never lost; it counts)."""
        record, shared = self.record, self.shared
        owner, keep = record.owner, shared.cfg.retention_s
        step = self._pacer().step

        def write():  # encoding a large file takes a while: off the event loop too, and paced
            parts = []
            for line in lines:
                parts.append(json.dumps(line) + "\n")
                step()
            content = "".join(parts).encode()
            return shared.files.create(content, f"{record.id}_{kind}.jsonl", "batch_output", owner, keep)

        made = await asyncio.to_thread(write)
        shared.add_file(made.owner, made.bytes)
        return made.id

    async def _fail(self, code: str, message: str) -> None:
        self.record.errors = [{"code": code, "message": message, "param": None, "line": None}]
        self.record.enter("failed")
        await self.shared.saver.save(self.record)

    def _pacer(self) -> Pacer:
        """Bookkeeping that yields the API process to online requests while any are in flight."""
        return Pacer(lambda: self.shared.gate.online_choices() > 0)

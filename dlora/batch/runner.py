"""Run a batch's request lines through the gate: the loop the server's batches and `dlora batch run` share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from dlora.batch.gate import BatchGate
from dlora.batch.lines import BatchLine
from dlora.server.admission import fanout_of_data

Execute = Callable[[BatchLine], Awaitable[dict]]


def line_choices(line: BatchLine) -> int:
    """The completions (engine requests) a line makes, prompts x n, as online admission counts them."""
    return fanout_of_data(line.url, line.body).choices


async def run_lines(
    lines: Sequence[BatchLine],
    execute: Execute,
    gate: BatchGate,
    on_done: Callable[[BatchLine, dict], None],
    stop: Callable[[], bool] = lambda: False,
    on_tick: Callable[[], None] = lambda: None,
    tick_s: float = 1.0,
) -> None:
    """Start each line once the gate has a place for it, in order; `on_done(line, output)` as each
    finishes. When `stop()` turns true nothing more starts and the running lines are cancelled
    (which aborts their engine requests); they are not reported. `on_tick` runs about every
    `tick_s` while lines run."""
    running: set[asyncio.Task] = set()

    async def one(line: BatchLine, choices: int) -> None:
        try:
            output = await execute(line)
        finally:
            gate.release(choices)
        on_done(line, output)

    last_tick = time.monotonic()
    try:
        for line in lines:
            choices = line_choices(line)
            if not await gate.acquire(stop, choices):
                break
            running.add(asyncio.create_task(one(line, choices)))
            running = {t for t in running if not t.done()}
            if time.monotonic() - last_tick >= tick_s:
                last_tick = time.monotonic()
                on_tick()
        while running and not stop():
            _, running = await asyncio.wait(running, timeout=tick_s)
            on_tick()
    finally:
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)

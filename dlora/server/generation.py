"""From vLLM's engine requests to the cluster: each completion is its own routed request.

`RouterEngineClient` (dlora.server.engine_client) hands its legs here; every leg runs on its own, so
the router can place, migrate and resubmit it independently, and its deltas come back in arrival
order, counted per adapter in /metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dlora.adapters.lifecycle import AdapterManager, AdapterResolveError, AdapterUnavailableError
from dlora.adapters.registry import AdapterNotFoundError, AdapterRecord
from dlora.adapters.resolver import AdapterSourceError
from dlora.replica.messages import Delta, GenerateRequest
from dlora.server.errors import APIError


@dataclass(frozen=True)
class ChoiceJob:
    """One completion (choice `index` of its prompt), as the request a replica runs."""

    index: int
    request: GenerateRequest


async def lookup_adapter(adapters: AdapterManager, model: str) -> AdapterRecord:
    """The adapter named `model`, registered or found by a resolver; else dlora's APIError saying
    why it cannot be served (404 unknown, 400 bad files, 503 source or stored copy unavailable)."""
    try:
        return await adapters.lookup_or_resolve(model)
    except AdapterSourceError:
        raise APIError(
            503, f"The adapter `{model}` could not be looked up: its source is not reachable; retry later.", "model"
        ) from None
    except AdapterResolveError:
        raise APIError(
            400,
            f"The adapter `{model}` was found but could not be loaded: its files failed validation "
            "(the server log says why).",
            "model",
        ) from None
    except AdapterUnavailableError:
        # Registered, but its stored copy changed or vanished: the operator must register it again.
        raise APIError(
            503,
            f"The adapter `{model}` is registered but its stored files are damaged or missing; "
            "it cannot be served until it is registered again.",
            "model",
        ) from None
    except AdapterNotFoundError:
        raise APIError(404, f"The model `{model}` does not exist.", "model") from None


STOP = object()  # put in run_jobs' queue: the run ends there, as if its caller had left


async def run_jobs(
    state, jobs: list[ChoiceJob], adapter_label: str, queue: asyncio.Queue | None = None
) -> AsyncIterator[tuple[ChoiceJob, Delta]]:
    """Run every job concurrently and yield (job, delta) in arrival order.

    Leaving the iterator early (client disconnect, error) cancels every job, which aborts the
    requests inside the engines; so does `STOP` put in `queue` (the caller's, when given).
    """
    queue = asyncio.Queue() if queue is None else queue
    done_marker = object()

    async def run(job: ChoiceJob) -> None:
        tracker = state.metrics.track(adapter_label, len(job.request.prompt_token_ids))
        status = "error"
        try:
            async for delta in state.router.generate(job.request):
                tracker.on_tokens(len(delta.token_ids))
                await queue.put((job, delta))
            status = "ok"
        except asyncio.CancelledError:
            status = "aborted"
            raise
        except Exception as e:
            await queue.put((job, e))
        finally:
            tracker.finish(status)
            await queue.put((job, done_marker))

    tasks = [asyncio.create_task(run(j)) for j in jobs]
    remaining = len(tasks)
    try:
        while remaining:
            got = await queue.get()
            if got is STOP:
                return
            job, item = got
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield job, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

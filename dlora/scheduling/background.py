"""Background work (batch jobs) runs only in the engine steps online work leaves.

Batch requests carry an engine priority of `batch.priority` or more. Ordering them after online
requests (dynamic_batching.fcfs_key) is not enough: a step that serves one online request and
fills the rest of its batch with batch requests takes as long as the full batch (on a CPU, a
decode step of 64 requests costs several times one of a few), so every online token would wait
on batch work. So while any online request is in a step, that step runs no batch request; batch
requests already running keep their KV and resume in the next step without online work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def without_background(
    allowed: Sequence[str], priority_of: Callable[[str], int], background_from: int | None
) -> list[str]:
    """`allowed` less its background requests (priority >= `background_from`) when it holds any
    other request; all of `allowed` when it holds only background work or no threshold is set."""
    if background_from is None:
        return list(allowed)
    foreground = [rid for rid in allowed if priority_of(rid) < background_from]
    return foreground or list(allowed)

"""What vLLM's scheduler sees of its queues in a step: which requests, and in which order (pure).

Runs inside vLLM's EngineCore process; no vLLM import: requests are anything with a `request_id`.

Hiding: the requests a step's plan does not allow are taken out of `running` / `waiting` /
`kv_holding_waiting` while vLLM's `Scheduler.schedule()` runs, then put back. They keep their KV
blocks and their RUNNING status and are never preempted (only visible requests are preemption
victims). `scheduler.py` swaps the queues; here is which request goes where:
- `split`: the visible and the hidden requests of a queue, each in queue order;
- `in_rank_order`: the visible waiting requests in the plan's order (vLLM admits in queue order);
- `running_after`: the running list once vLLM has scheduled the visible ones (some preempted, some
  newly admitted), with the hidden ones back in their places.

Service order: with a policy order other than FCFS (or KV quotas on), vLLM's waiting queues are
priority heaps, and each request's priority becomes its place (`service_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar


class Queued(Protocol):
    @property
    def request_id(self) -> str: ...


R = TypeVar("R", bound=Queued)


def split(queue: Iterable[R], visible: Collection[str]) -> tuple[list[R], list[R]]:
    """(the requests of `queue` in `visible`, the others), each in queue order."""
    shown: list[R] = []
    hidden: list[R] = []
    for r in queue:
        (shown if r.request_id in visible else hidden).append(r)
    return shown, hidden


def in_rank_order(requests: Iterable[R], visible_order: Sequence[str]) -> list[R]:
    """`requests` (all visible) in the order of `visible_order`."""
    rank = {rid: i for i, rid in enumerate(visible_order)}
    return sorted(requests, key=lambda r: rank[r.request_id])


def running_after(before: Sequence[R], after: Sequence[R], visible: Collection[str]) -> list[R]:
    """The running list after vLLM scheduled the visible requests of `before` (the running list it
    was not shown in full) and left `after`: `before` less the visible requests vLLM dropped
    (preempted, finished), in its order, then the requests vLLM newly admitted."""
    kept = {id(r) for r in after}
    old = {id(r) for r in before}
    return [r for r in before if id(r) in kept or r.request_id not in visible] + [r for r in after if id(r) not in old]


def service_order(
    requests: Iterable[R],
    client_priority: Mapping[str, int],
    borrowers: Collection[Hashable],
    adapter_of: Callable[[R], Hashable],
    visible_order: Sequence[str],
) -> list[R]:
    """`requests` in the order the step serves them: by the priority their clients asked for, then
    the adapters borrowing KV quota last, then the plan's order (requests it does not show last)."""
    rank = {rid: i for i, rid in enumerate(visible_order)}
    last = len(rank)

    def place(r: R) -> tuple:
        return (client_priority.get(r.request_id, 0), adapter_of(r) in borrowers, rank.get(r.request_id, last))

    return sorted(requests, key=place)

"""Where a discipline of the replica model changes it: the hooks `ModelledCluster` calls.

The defaults are dispatch at arrival with nothing moving: each request waits in the queue of the
replica it was sent to, nothing else is admitted or scheduled. A discipline (`disciplines.py`,
`elastic.py`) overrides the hooks it needs; `ModelledCluster.place` and `serving` are hooks too,
kept beside the dispatch and the replicas they default to.
"""

from __future__ import annotations

from dlora.sim.sim_replica import SimReplica


class DisciplineHooks:
    def first_events(self) -> None:
        """Events to schedule besides the arrivals, before the first is handled."""

    def arrived(self, t: float, i: int) -> None:
        """Request i has just been queued on the replica it was sent to."""

    def waiting_queue(self, r: SimReplica) -> list[int]:
        """The queue `r` admits from, and where its preempted requests go back to."""
        return r.queue

    def more_to_admit(self, t: float, r: SimReplica) -> list[tuple[int, list[int]]]:
        """Requests `r` may also start at this step, after its own queue's (request, its queue)."""
        return []

    def after_preemption(self, t: float) -> None:
        """A replica has just preempted requests for KV."""

    def freed(self, t: float, r: SimReplica) -> None:
        """`r`'s step has just ended with requests finished: running slots are free there."""

    def moved_to(self, t: float, i: int) -> None:
        """Request i has just been moved to another replica's queue."""

    def waited(self, t: float, i: int) -> None:
        """Request i, still not admitted, reached a wait a discipline set (`WAITED`)."""

    def tick(self, t: float) -> None:
        """A periodic event a discipline set (`TICK`)."""

    def event(self, t: float, kind: int, index: int) -> None:
        """An event of a kind a subclass adds (after `TICK`)."""
        raise ValueError(f"unknown event kind {kind}")

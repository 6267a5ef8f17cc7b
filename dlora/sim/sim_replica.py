"""One replica of the replica model (`replica_model.py`): its queue, running requests, resident
adapters and whether a step is under way. Request indices are the trace's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimReplica:
    rid: int
    queue: list[int] = field(default_factory=list)  # job indices in arrival order (not late binding)
    running: list[int] = field(default_factory=list)
    resident: dict[str, float] = field(default_factory=dict)  # adapter -> last use (LRU)
    busy: bool = False  # a step is running or about to start
    step_ends: float = 0.0  # when its last step started ends

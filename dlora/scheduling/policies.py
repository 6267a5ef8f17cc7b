"""The batching-policy interface and the two baselines (`unmerged`, `merged`).

A policy is called by the engine's scheduler once per step: `decide` picks the mode and the
requests allowed to run (the engine schedules within its own token/KV budgets and keeps the KV
of hidden requests), then `observe` receives what the step measured. Time is always passed in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from dlora.scheduling.config import BatchingConfig
from dlora.scheduling.dynamic_batching import build_queues, request_ids
from dlora.scheduling.types import (
    AdapterKey,
    Decision,
    IterationStats,
    Mode,
    PolicySnapshot,
    RequestView,
    Switch,
)


class BatchingPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, config: BatchingConfig | None = None) -> None:
        self.config = config or BatchingConfig()

    def batch_size(self, max_batch: int | None) -> int:
        """max_bs for this step: the caller's value, else the config's."""
        n = self.config.max_batch if max_batch is None else max_batch
        if n < 1:
            raise ValueError(f"max_batch={n}: must be >= 1")
        return n

    @abstractmethod
    def decide(self, requests: Sequence[RequestView], now: float, max_batch: int | None = None) -> Decision:
        """The mode and allowed requests for the next step (never empty while requests exist)."""

    @abstractmethod
    def observe(self, stats: IterationStats) -> None:
        """Feed back what the step that ran under the last decision measured."""

    @abstractmethod
    def snapshot(self) -> PolicySnapshot:
        """State for /metrics."""


def check_decision(
    decision: Decision,
    requests: Sequence[RequestView],
    max_batch: int | None = None,
    mixed: bool = False,
) -> None:
    """Raise ValueError if `decision` breaks the contract the engine integration relies on;
    `mixed`: the engine compensates other requests on merged weights (`mixed_merged`)."""
    by_id = {r.req_id: r for r in requests}
    allowed = decision.allowed_req_ids
    if requests and not allowed:
        raise ValueError("empty allowed set while requests are unfinished")
    if len(set(allowed)) != len(allowed) or not set(allowed) <= by_id.keys():
        raise ValueError(f"allowed ids must be distinct known requests: {allowed}")
    if max_batch is not None and len(allowed) > max_batch:
        raise ValueError(f"{len(allowed)} allowed > max_batch {max_batch}")
    if decision.mode is Mode.MERGED:
        if decision.merged_adapter is None:
            raise ValueError("MERGED without a merged adapter")
        others = [i for i in allowed if by_id[i].adapter != decision.merged_adapter]
        if others and not mixed:
            raise ValueError(f"requests {others} would run on {decision.merged_adapter!r} merged weights")
    elif decision.merged_adapter is not None or decision.switch is Switch.MERGE:
        raise ValueError("UNMERGED decision names a merged adapter or a MERGE switch")
    if decision.switch is Switch.UNMERGE and decision.mode is not Mode.UNMERGED:
        raise ValueError("UNMERGE switch must leave the replica UNMERGED")


class UnmergedPolicy(BatchingPolicy):
    """Always unmerged, the FCFS batch allowed (the first max_batch requests in FCFS order): vLLM's
    own behaviour, whose scheduler admits no more than max_num_seqs either."""

    name = "unmerged"

    def decide(self, requests: Sequence[RequestView], now: float, max_batch: int | None = None) -> Decision:
        return Decision(Mode.UNMERGED, None, request_ids(build_queues(requests, self.batch_size(max_batch)).fcfs))

    def observe(self, stats: IterationStats) -> None:
        pass

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(self.name, Mode.UNMERGED, None, 0)


class MergedPolicy(BatchingPolicy):
    """One model at a time (the PEFT-style baseline): never mixes adapters in a step.

    It serves the model of the oldest request (an adapter merged, or the base model unmerged) and
    stays with it until its queue is empty, or for at most `merged_max_iters` steps while other
    requests wait; then it moves to the model of the oldest request of another model. It goes from
    one merged adapter straight to the next (the engine unmerges and merges before the same step).
    """

    name = "merged"

    def __init__(self, config: BatchingConfig | None = None) -> None:
        super().__init__(config)
        self.mode = Mode.UNMERGED
        self.merged: str | None = None
        self.target: AdapterKey = None
        self.has_target = False
        self.iters = 0  # steps spent on the current target
        self.num_switches = 0

    def decide(self, requests: Sequence[RequestView], now: float, max_batch: int | None = None) -> Decision:
        if not requests:
            return Decision(self.mode, self.merged, ())
        q = build_queues(requests, self.batch_size(max_batch))
        target = self._next_target(q.groups, [r.adapter for r in q.ordered])
        if not self.has_target or target != self.target:
            self.target, self.has_target, self.iters = target, True, 0
        self.iters += 1
        batch = request_ids(q.group(target)[: q.max_batch])
        if target is not None and (self.mode is Mode.UNMERGED or self.merged != target):
            return self._switch(Mode.MERGED, target, Switch.MERGE, batch)
        if target is None and self.mode is Mode.MERGED:
            return self._switch(Mode.UNMERGED, None, Switch.UNMERGE, batch)
        return Decision(self.mode, self.merged, batch)

    def _next_target(self, groups: dict, fcfs_adapters: list[AdapterKey]) -> AdapterKey:
        current_busy = self.has_target and self.target in groups
        if current_busy and (len(groups) == 1 or self.iters < self.config.merged_max_iters):
            return self.target
        for adapter in fcfs_adapters:  # oldest request of another model (or of any, if idle)
            if not current_busy or adapter != self.target:
                return adapter
        return self.target

    def _switch(self, mode: Mode, adapter: str | None, switch: Switch, batch: tuple[str, ...]) -> Decision:
        self.mode, self.merged = mode, adapter
        self.num_switches += 1
        return Decision(mode, adapter, batch, switch)

    def observe(self, stats: IterationStats) -> None:
        # Adopt what actually ran (e.g. a failed merge left the replica unmerged).
        self.mode, self.merged = stats.mode, stats.merged_adapter

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(self.name, self.mode, self.merged, self.num_switches)

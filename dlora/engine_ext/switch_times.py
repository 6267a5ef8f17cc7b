"""The measured durations of one kind of weight switch (merge or unmerge) since the engine started.

Runs inside vLLM's EngineCore process. The engine counts, /metrics renders the counts as they are
(`SwitchTimes`, with cumulative buckets as Prometheus wants them).
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import accumulate

from dlora.replica.messages import SWITCH_SECONDS_BUCKETS, SwitchTimes

RECENT_SWITCHES = 64  # durations kept per kind for the batching state


class SwitchHistogram:
    def __init__(self) -> None:
        self.count, self.total = 0, 0.0
        self.buckets = [0] * len(SWITCH_SECONDS_BUCKETS)  # non-cumulative here
        self.recent: deque[float] = deque(maxlen=RECENT_SWITCHES)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        i = bisect.bisect_left(SWITCH_SECONDS_BUCKETS, seconds)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.recent.append(seconds)

    def times(self) -> SwitchTimes:
        return SwitchTimes(self.count, self.total, tuple(accumulate(self.buckets)), tuple(self.recent))

"""The engine's measurements for the router, numbered so that reading them takes nothing away.

Runs inside vLLM's EngineCore process.

Each engine step's cost (`StepSample`, for the router's per-replica cost model) and each request's
wait before its first step (`QueueWait`, for the queue-time histogram) go into one bounded ring;
every sample gets the next sequence number. A reader asks for the samples after the last number it
saw, and the answer names the newest number (`BatchingState.samples_seq`). So any number of readers
(the replica's stats read, a debugging probe, a test) see every sample without taking one from
another, and a read has no side effect. A reader that falls more than the ring's length behind
misses the oldest ones; a reader whose number is past the newest one was reading an engine that has
since been replaced, and gets everything kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from itertools import islice
from typing import NamedTuple

MAX_SAMPLES = 65_536  # steps and waits kept; the replica's stats are read about once a second


class StepSample(NamedTuple):
    """One measured engine step, its switch time excluded; a request scheduled for one token is decoding."""

    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    merged: bool


class QueueWait(NamedTuple):
    """How long an engine request waited in the scheduler before its first step."""

    request_id: str
    seconds: float


Sample = StepSample | QueueWait


def prefill_tokens(num_scheduled_tokens: Mapping[str, int], total: int) -> int:
    """Prompt tokens a step computed: a request scheduled for one token is decoding (vLLM's
    scheduler gives a prefill chunk more; a one-token prompt chunk counts as a decode, which
    prices the same)."""
    return total - sum(1 for n in num_scheduled_tokens.values() if n == 1)


def step_sample(num_scheduled_tokens: Mapping[str, int], total: int, seconds: float, merged: bool) -> StepSample | None:
    """The cost sample of a step that scheduled `num_scheduled_tokens` per request (`total` in
    all) in `seconds`, switch time excluded; None for a step that ran nothing."""
    if not num_scheduled_tokens or seconds <= 0:
        return None
    prefill = prefill_tokens(num_scheduled_tokens, total)
    return StepSample(len(num_scheduled_tokens), prefill, total - prefill, seconds, merged)


class SampleLog:
    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._ring: deque[Sample] = deque(maxlen=max_samples)
        self.seq = 0  # the number of the newest sample (0: none yet)

    def append(self, sample: Sample) -> None:
        self.seq += 1
        self._ring.append(sample)

    def since(self, seq: int) -> list[Sample]:
        """The samples numbered after `seq`, oldest first (as many as the ring still holds)."""
        if seq > self.seq:  # a number from an engine this one replaced
            seq = 0
        newer = min(self.seq - seq, len(self._ring))
        return list(islice(reversed(self._ring), newer))[::-1]


def split(samples: list[Sample]) -> tuple[tuple[StepSample, ...], tuple[QueueWait, ...]]:
    """(the step samples, the queue waits) of `samples`, each in order."""
    steps = tuple(s for s in samples if isinstance(s, StepSample))
    return steps, tuple(s for s in samples if isinstance(s, QueueWait))

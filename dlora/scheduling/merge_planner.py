"""The merge planner: merge an adapter when serving its queued work merged, then the rest unmerged,
is predicted to finish the known work sooner than serving it all unmerged.

Why, beside Alg. 1's threshold: Alg. 1 merges only an adapter whose share of the FCFS batch is above
`alpha`, and Alg. 2 keeps `alpha` above `beta` + a gap, so at middling skew it never merges. Yet
where the LoRA term is dear (long prompts, high rank on every projection) serving the adapters one
after another, each merged at base-model speed, beats batching them unmerged by 1.1-1.5x on one
CPU core, even at uniform popularity. The planner prices that choice with the step-time model
(`step_model.py`) over the work the replica already holds, so it merges where the model says the
batching lost is worth less than the LoRA work saved, whatever the share.

The work of a set of requests S, in a weight state with step line (fixed, per_prefill_token,
per_seq), running together to completion:

    T(S) = fixed · steps(S) + per_prefill_token · P(S) + per_seq · D(S)
    steps(S) = max(longest remaining output in S, ceil(D(S) / max_batch))

with P(S) the prompt tokens still to compute and D(S) the output tokens still to generate (each
request's remaining output: the mean, over the recently finished requests that ran longer than it
has so far, of how much longer they ran; as long again as it has run when none did; within its
cap, at least 1). Why conditioned: output lengths are heavy-tailed, and a request that has outrun
the mean is not about to finish; priced at one token left, it is worth a merged slice of its own,
again at every step it does not finish.

The plan "merge X now": switch in, T_merged(X's requests), switch out, then the rest.
Its gain over "stay unmerged" is

    gain(X) = T_unmerged(all) - [2 · t_switch + T_merged(X) + R(rest)]

where R(rest), the time of the rest after the slice, is the sooner of T_unmerged(rest) and slicing
it too (each adapter merged in turn, one switch each): a plan one slice deep would not see that
slicing every adapter beats batching them all when no single slice does. X is merged when
gain(X) > margin · T_merged(X). Merged on X, the replica stays merged while the gain, less the
switch already paid, stays positive. Finishing
the known work sooner is the most output per second the replica can give the requests it holds;
who waits meanwhile is Alg. 3's business (credits bound the wait).

Pure functions over `RequestView`s; the policy (`dlora_policy.py`) owns the state.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dlora.cost.line import StepLine
from dlora.scheduling.types import AdapterKey, RequestView

RECENT_LENGTHS = 64  # finished requests whose output lengths predict the next ones
DEFAULT_OUTPUT_TOKENS = 128  # a request with no cap, before any request finished


@dataclass(frozen=True, slots=True)
class RemainingWork:
    """Known work of a set of requests: what T(S) above needs."""

    prompt_tokens: int = 0  # P: prompt tokens still to compute
    output_tokens: int = 0  # D: output tokens still to generate
    longest: int = 0  # the longest remaining output in the set

    def __add__(self, other: RemainingWork) -> RemainingWork:
        return RemainingWork(
            self.prompt_tokens + other.prompt_tokens,
            self.output_tokens + other.output_tokens,
            max(self.longest, other.longest),
        )

    @property
    def empty(self) -> bool:
        return self.output_tokens == 0 and self.prompt_tokens == 0


class LengthTail:
    """Recent output lengths, sorted, with suffix sums: how much longer the requests that ran
    past `g` tokens ran, on average, in O(log n)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.sorted = sorted(lengths)
        self._suffix = [0] * (len(self.sorted) + 1)
        for i in range(len(self.sorted) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + self.sorted[i]

    def __bool__(self) -> bool:
        return bool(self.sorted)

    def expected_after(self, generated: int) -> float:
        """Mean of (length - generated) over the lengths above `generated`; `generated` (as long
        again) when none is, at least 1."""
        first = bisect.bisect_right(self.sorted, generated)
        longer = len(self.sorted) - first
        if longer == 0:
            return float(max(1, generated))
        return self._suffix[first] / longer - generated


def remaining_output(r: RequestView, tail: LengthTail | None) -> int:
    """Output tokens `r` is expected to generate still (>= 1 while it is unfinished): the recent
    lengths' expectation given what it has generated, within its cap; the cap (a default when it
    has none) before any request finished."""
    left_in_cap = float("inf") if r.max_tokens is None else float(r.max_tokens - r.num_output_tokens)
    if not tail:
        expected = float(DEFAULT_OUTPUT_TOKENS - r.num_output_tokens) if r.max_tokens is None else left_in_cap
    else:
        expected = min(left_in_cap, tail.expected_after(r.num_output_tokens))
    return max(1, math.ceil(expected))


def work_by_adapter(requests: Iterable[RequestView], tail: LengthTail | None) -> dict[AdapterKey, RemainingWork]:
    """The requests' known work, by adapter (None: the base model)."""
    out: dict[AdapterKey, RemainingWork] = {}
    for r in requests:
        d = remaining_output(r, tail)
        w = RemainingWork(max(0, r.num_prompt_tokens - r.num_computed_tokens), d, d)
        out[r.adapter] = out.get(r.adapter, RemainingWork()) + w
    return out


def work_seconds(line: StepLine, work: RemainingWork, max_batch: int) -> float:
    """T(S): the seconds `work` takes run together in a weight state with step `line`."""
    if work.empty:
        return 0.0
    steps = max(work.longest, math.ceil(work.output_tokens / max(1, max_batch)))
    return line.fixed_s * steps + line.per_prefill_token_s * work.prompt_tokens + line.per_seq_s * work.output_tokens


def total(works: Iterable[RemainingWork]) -> RemainingWork:
    out = RemainingWork()
    for w in works:
        out = out + w
    return out


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """The planner's verdict on merging `adapter` now."""

    adapter: str
    gain_s: float  # predicted seconds saved over staying unmerged (switches included)
    merged_s: float  # T_merged of the adapter's work

    def pays(self, margin: float) -> bool:
        return self.gain_s > margin * self.merged_s


def rest_seconds(
    works: Mapping[AdapterKey, RemainingWork], unmerged: StepLine, merged: StepLine, switch_s: float, max_batch: int
) -> float:
    """R(S) of the docstring: the work after a slice, run all unmerged or sliced adapter by adapter
    (each merged, one switch each; the base model's requests unmerged), whichever is sooner."""
    together = work_seconds(unmerged, total(works.values()), max_batch)
    sliced = sum(
        work_seconds(unmerged, w, max_batch) if key is None else switch_s + work_seconds(merged, w, max_batch)
        for key, w in works.items()
        if not w.empty
    )
    return min(together, sliced)


def slice_gain(
    works: Mapping[AdapterKey, RemainingWork],
    adapter: str,
    unmerged: StepLine,
    merged: StepLine,
    switch_s: float,
    max_batch: int,
) -> SlicePlan:
    """gain(adapter) of the docstring: T_unmerged(all) - [2 t_switch + T_merged(X) + R(rest)]."""
    everything = total(works.values())
    own = works.get(adapter, RemainingWork())
    rest = {a: w for a, w in works.items() if a != adapter}
    merged_s = work_seconds(merged, own, max_batch)
    planned = 2 * switch_s + merged_s + rest_seconds(rest, unmerged, merged, switch_s, max_batch)
    return SlicePlan(adapter, work_seconds(unmerged, everything, max_batch) - planned, merged_s)


def stay_pays(
    works: Mapping[AdapterKey, RemainingWork],
    adapter: str,
    unmerged: StepLine,
    merged: StepLine,
    switch_s: float,
    max_batch: int,
) -> bool:
    """Merged on `adapter`: finishing its work merged, then the rest, beats unmerging now (the
    switch into this slice is paid already)."""
    if works.get(adapter, RemainingWork()).empty:
        return False
    # slice_gain charges the switches into and out of the slice; merged already, the switch in is
    # paid and the switch out comes either way.
    return slice_gain(works, adapter, unmerged, merged, switch_s, max_batch).gain_s + 2 * switch_s > 0


class FinishedLengths:
    """Output lengths of the requests that left the engine: the last `RECENT_LENGTHS` per adapter
    and pooled.

    The policy sees every unfinished request each step; one that is gone has finished (or was
    aborted or moved: its length is a lower bound, which is what is known)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[AdapterKey, int]] = {}
        self._recent: deque[int] = deque(maxlen=RECENT_LENGTHS)
        self._by_adapter: dict[AdapterKey, deque[int]] = {}

    def update(self, requests: Sequence[RequestView]) -> None:
        now = {r.req_id: (r.adapter, r.num_output_tokens) for r in requests}
        for rid, (adapter, n) in self._last.items():
            if rid not in now:
                length = n + 1  # its last step, after the last view, made one more
                self._recent.append(length)
                self._by_adapter.setdefault(adapter, deque(maxlen=RECENT_LENGTHS)).append(length)
        self._last = now

    def pooled(self) -> tuple[int, ...]:
        """The recent lengths, every adapter's."""
        return tuple(self._recent)

    def of(self, adapter: AdapterKey) -> tuple[int, ...]:
        """The recent lengths of `adapter`'s requests."""
        return tuple(self._by_adapter.get(adapter, ()))

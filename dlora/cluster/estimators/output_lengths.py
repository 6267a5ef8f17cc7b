"""How many tokens a request will generate: a per-adapter empirical distribution of output lengths.

Why: real clients set `max_tokens` as a cap far above what the model writes, so pricing a request
by its cap makes every request look alike, and
neither can tell a replica whose requests will end soon from one whose requests will run on.
SamuLLM's insight ("output length is a distribution"): a model's output lengths
follow a distribution that hardly depends on the request, so the lengths of its completed requests
predict the next ones. Here the "model" is an adapter: each keeps the lengths of its last
`window` completed requests.

What it answers, for an adapter with sample lengths L and a request with cap m = max_tokens:
  * a new (or requeued, nothing generated yet) request: E[min(L, m)];
  * a request that has generated g tokens: g + E[min(L, m) - g | L > g], i.e. the remaining
    output conditioned on having survived g tokens (a request that has run long is likely to run
    longer when the distribution is heavy-tailed, which a plain mean ignores).
Cold start: an adapter with fewer than `min_samples` lengths uses the pooled lengths of every
adapter (the last `window` completions of any adapter), and with none, the prior: `prior_tokens`
(a request expects min(prior, m - g) more tokens, memoryless) or, when the prior is None, its cap
(the pre-estimator behaviour). When no sample exceeds g (the request outlived its history), it
expects as many tokens again as it has (min(g, m - g)): the same median-lifetime guess as a
geometric tail, instead of 0 (it has not finished) or the cap.

A request that stopped at its cap ("length") is recorded at the cap: a lower bound of its true
length. Each length keeps whether the request ended by itself, so a censoring-aware estimate
(estimators/survival.py, for the batch planner) can tell the two apart. Queries are O(log n):
each distribution is kept sorted with prefix sums, rebuilt lazily after new completions. Pure
Python, no clock; the router feeds it (router.py). `length_stats` turns an adapter's lengths into
SeaLLM's profile (`dlora.slo.priority.LengthStats`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dlora.cluster.estimators.survival import Observation
from dlora.slo.priority import LengthStats

AdapterName = str | None


@dataclass(frozen=True, slots=True)
class OutputLengthConfig:
    window: int = 256  # completed requests kept per adapter (and pooled); 0 = price every request at its cap
    min_samples: int = 8  # an adapter's own lengths are used once it has this many
    prior_tokens: int | None = None  # cold-start expectation; None = the request's max_tokens

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"output length window={self.window}: must be >= 0")
        if self.min_samples < 1:
            raise ValueError(f"output length min_samples={self.min_samples}: must be >= 1")
        if self.prior_tokens is not None and self.prior_tokens < 1:
            raise ValueError(f"output length prior_tokens={self.prior_tokens}: must be >= 1 (or None)")


@dataclass(frozen=True)
class LengthHistory:
    """Finished requests' (length, ended by itself) as the estimator holds them: each adapter's
    own (every adapter asked about has an entry), every adapter's together (`pooled`), and how
    many of its own an adapter needs before an estimate uses them rather than the pooled ones (the
    estimator's rule)."""

    own: Mapping[AdapterName, tuple[Observation, ...]]
    pooled: tuple[Observation, ...] = ()
    min_samples: int = 1

    def uses_own(self, adapter: AdapterName) -> bool:
        return len(self.own.get(adapter, ())) >= self.min_samples


class _Sorted:
    """A bounded window of lengths, with a sorted copy + prefix sums built on demand."""

    __slots__ = ("recent", "ended", "_sorted", "_prefix")

    def __init__(self, window: int) -> None:
        self.recent: deque[int] = deque(maxlen=max(1, window))
        self.ended: deque[bool] = deque(maxlen=max(1, window))  # False: stopped at its cap
        self._sorted: list[int] | None = None
        self._prefix: list[int] = []

    def add(self, length: int, ended: bool) -> None:
        self.recent.append(length)
        self.ended.append(ended)
        self._sorted = None

    def __len__(self) -> int:
        return len(self.recent)

    def _build(self) -> list[int]:
        if self._sorted is None:
            self._sorted = sorted(self.recent)
            self._prefix = [0, *itertools.accumulate(self._sorted)]
        return self._sorted

    def remaining(self, generated: int, cap: int) -> float | None:
        """E[min(L, cap) - g | L > g] over the window, or None when no length exceeds g."""
        s = self._build()
        lo = bisect.bisect_right(s, generated)  # s[lo:] > g
        n_above = len(s) - lo
        if n_above == 0:
            return None
        hi = max(lo, bisect.bisect_right(s, cap))  # s[lo:hi] in (g, cap], s[hi:] > cap
        total = self._prefix[hi] - self._prefix[lo] + cap * (len(s) - hi)
        return total / n_above - generated


class OutputLengthEstimator:
    """Per-adapter output-length distributions, fed with completed requests' lengths."""

    def __init__(self, cfg: OutputLengthConfig | None = None) -> None:
        self.cfg = cfg or OutputLengthConfig()
        self._by_adapter: dict[AdapterName, _Sorted] = {}
        self._pooled = _Sorted(self.cfg.window)

    @property
    def enabled(self) -> bool:
        return self.cfg.window > 0

    def observe(self, adapter: AdapterName, length: int, ended: bool = True) -> None:
        """Record one completed request of `adapter` that generated `length` tokens; `ended` is
        False when it stopped at its cap (its true length is longer)."""
        if not self.enabled or length < 0:
            return
        dist = self._by_adapter.get(adapter)
        if dist is None:
            dist = self._by_adapter[adapter] = _Sorted(self.cfg.window)
        dist.add(int(length), ended)
        self._pooled.add(int(length), ended)

    def samples(self, adapter: AdapterName) -> list[int]:
        """The adapter's recorded lengths, oldest first (for tests and debugging)."""
        dist = self._by_adapter.get(adapter)
        return list(dist.recent) if dist is not None else []

    def pooled_samples(self) -> list[int]:
        """Every adapter's recorded lengths together (the last `window`), oldest first: what an
        adapter with fewer than `min_samples` of its own is estimated from."""
        return list(self._pooled.recent)

    def lengths_for(self, adapter: AdapterName) -> list[int]:
        """The recent lengths an estimate for `adapter` draws on: its own once it has `min_samples`,
        else every adapter's; empty before any request finished (or when disabled)."""
        dist = self._source(adapter) if self.enabled else None
        return list(dist.recent) if dist is not None else []

    def history(self, adapters: Iterable[AdapterName]) -> LengthHistory:
        """A copy of the recorded lengths of `adapters` and of every adapter together, each with
        whether its request ended by itself, for a censoring-aware estimate (estimators/survival.py)."""
        if not self.enabled:
            return LengthHistory({a: () for a in adapters})
        own = {a: tuple(zip(d.recent, d.ended)) if (d := self._by_adapter.get(a)) else () for a in adapters}
        return LengthHistory(own, tuple(zip(self._pooled.recent, self._pooled.ended)), self.cfg.min_samples)

    def _source(self, adapter: AdapterName) -> _Sorted | None:
        dist = self._by_adapter.get(adapter)
        if dist is not None and len(dist) >= self.cfg.min_samples:
            return dist
        return self._pooled if len(self._pooled) else None

    def expected_remaining(self, adapter: AdapterName, generated: int, max_tokens: int) -> float:
        """Tokens a request of `adapter` is expected to generate after the `generated` it has,
        never more than `max_tokens - generated` (0 once it reached its cap)."""
        room = max_tokens - generated
        if room <= 0:
            return 0.0
        if not self.enabled:
            return float(room)
        dist = self._source(adapter)
        if dist is None:  # no completion seen anywhere yet: the prior
            return float(room if self.cfg.prior_tokens is None else min(room, self.cfg.prior_tokens))
        est = dist.remaining(generated, max_tokens)
        if est is None and dist is not self._pooled and len(self._pooled):
            est = self._pooled.remaining(generated, max_tokens)  # other adapters ran this long
        if est is None:  # longer than anything seen: as many again as it has
            est = float(max(1, generated))
        return float(min(room, max(est, 1.0)))

    def expected_total(self, adapter: AdapterName, generated: int, max_tokens: int) -> float:
        """Total output expected: what it has plus what it is expected to generate."""
        return generated + self.expected_remaining(adapter, generated, max_tokens)


def length_stats(estimator: OutputLengthEstimator, adapter: AdapterName, fallback: LengthStats) -> LengthStats:
    """The adapter's SeaLLM profile from the estimator's recorded lengths once it has the
    estimator's `min_samples`, else `fallback` (e.g. the pooled profile or a configured prior)."""
    samples = estimator.samples(adapter)
    if len(samples) < estimator.cfg.min_samples:
        return fallback
    return LengthStats.of(samples)

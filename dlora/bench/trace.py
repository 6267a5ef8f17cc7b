"""Replay of an Azure Functions 2019 per-minute trace, mapped to adapters as dLoRA does.

File layout (one CSV per day, `invocations_per_function_md.anon.dNN.csv`):
    HashOwner,HashApp,HashFunction,Trigger,1,2,...,1440
one row per function, column "m" = invocations in minute m of the day.

dLoRA's replay (artifact `vllm/workload_generator/trace.py`), reimplemented:
1. keep the window of minutes [start, end) and drop functions with no invocation in it;
2. sort functions by invocations in the window, most first;
3. map sorted function k to adapter (k // stride) mod N (`popularity.stride_mapping`);
4. cut the window into intervals of `interval` minutes and count each adapter's invocations;
5. in interval i adapter a gets rate λ_a,i = count_a,i / Σ_b count_b,i · λ_total;
6. split the requests evenly over the intervals; interval i's share is the first arrivals of
   per-adapter Gamma(CV) processes at those rates, started where interval i−1 ended.
So the total rate is always λ_total and the trace only decides the adapter mix over time.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlora.bench.arrivals import merged_arrivals
from dlora.bench.popularity import stride_mapping

ID_COLUMNS = ("HashOwner", "HashApp", "HashFunction")
MINUTES_PER_DAY = 1440


@dataclass(frozen=True)
class FunctionTrace:
    function_ids: tuple[str, ...]  # "owner/app/function", sorted by invocations, most first
    counts: np.ndarray  # [num_functions, window minutes] invocations per minute
    start_minute: int


def load_azure_trace(path: str | Path, start_minute: int = 0, end_minute: int = MINUTES_PER_DAY) -> FunctionTrace:
    """Read the window [start_minute, end_minute) of a day file, busiest function first."""
    if not 0 <= start_minute < end_minute <= MINUTES_PER_DAY:
        raise ValueError(f"trace window {start_minute}:{end_minute}: need 0 <= start < end <= {MINUTES_PER_DAY}")
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"trace file {str(path)!r} is empty")
        missing = [c for c in ID_COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"trace file {str(path)!r}: missing column(s) {missing}; expected the Azure Functions 2019 layout"
            )
        try:
            cols = [header.index(str(m)) for m in range(start_minute + 1, end_minute + 1)]
        except ValueError:
            raise ValueError(
                f"trace file {str(path)!r} has no per-minute columns for minutes {start_minute + 1}..{end_minute}"
            ) from None
        id_cols = [header.index(c) for c in ID_COLUMNS]
        ids: list[str] = []
        rows: list[list[int]] = []
        for row in reader:
            row_counts = [int(float(row[c] or 0)) for c in cols]
            if sum(row_counts):
                ids.append("/".join(row[c] for c in id_cols))
                rows.append(row_counts)
    counts = np.array(rows, dtype=np.int64).reshape(len(rows), len(cols))
    order = np.argsort(-counts.sum(axis=1), kind="stable")
    return FunctionTrace(tuple(ids[i] for i in order), counts[order], start_minute)


def adapter_interval_counts(
    trace: FunctionTrace, num_adapters: int, stride: int = 1, interval_minutes: int = 60
) -> np.ndarray:
    """[num_intervals, num_adapters] invocations of the functions mapped to each adapter."""
    num_functions, minutes = trace.counts.shape
    if num_functions < num_adapters:
        raise ValueError(
            f"trace has {num_functions} active function(s) in the window, fewer than {num_adapters} adapters"
        )
    if interval_minutes < 1:
        raise ValueError(f"trace interval={interval_minutes}: must be >= 1 minute")
    mapping = stride_mapping(num_functions, num_adapters, stride)
    per_adapter = np.zeros((num_adapters, minutes), dtype=np.int64)
    np.add.at(per_adapter, mapping, trace.counts)
    edges = np.arange(0, minutes, interval_minutes)
    return np.add.reduceat(per_adapter, edges, axis=1).T


def interval_rates(counts: np.ndarray, total_rate: float) -> np.ndarray:
    """λ_a,i = count_a,i / Σ_b count_b,i · total_rate (intervals without calls get rate 0)."""
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts * total_rate, totals, out=np.zeros(counts.shape), where=totals > 0)


def replay_arrivals(
    rates: np.ndarray, num_requests: int, rng: np.random.Generator, cv: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times, adapter index) of `num_requests` requests spread evenly over the intervals."""
    busy = [i for i in range(len(rates)) if rates[i].sum() > 0]
    per_interval = np.full(len(busy), num_requests // len(busy))
    per_interval[: num_requests % len(busy)] += 1
    times, adapters, start = [], [], 0.0
    for i, n in zip(busy, per_interval):
        if n == 0:
            continue
        t, a = merged_arrivals(rates[i], int(n), rng, cv=cv, start=start)
        times.append(t)
        adapters.append(a)
        start = float(t[-1])
    return np.concatenate(times), np.concatenate(adapters)

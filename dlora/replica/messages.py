"""Plain dataclasses that cross the router ↔ replica boundary (Ray pickles them).

The router owns each request's token state (prompt ids + every token received), so a request can
be resubmitted to another replica as `prompt + generated` after a migration or a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdapterRef:
    """What an engine needs to load an adapter: vLLM's LoRARequest fields."""

    name: str
    int_id: int
    path: str


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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    adapter: AdapterRef | None = None  # None = the base model


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str
    # (token_id, logprob, token) of the top alternatives, best first
    top: tuple[tuple[int, float, str], ...] = ()


@dataclass
class Delta:
    """New output of one request since the previous Delta."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None


@dataclass
class ReplicaStats:
    replica_id: int
    num_unfinished: int
    resident_adapter_ids: list[int] = field(default_factory=list)
    healthy: bool = True

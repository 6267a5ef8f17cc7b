"""One request as the router holds it: its tokens so far, its current leg, and what it weighs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.interruptible import InterruptibleStream
from dlora.cluster.policy_views import RequestLoad
from dlora.cluster.prefix_locality import PromptBlocks
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.replica.messages import GenerateRequest


@dataclass
class RequestState:
    request: GenerateRequest
    arrival: float
    generated: list[int] = field(default_factory=list)
    resubmissions: int = 0
    slot: ReplicaSlot | None = None  # the current leg's replica (from its adapter load on)
    engine_request_id: str | None = None  # the current leg's id on its replica, once sent there
    # The current leg left vLLM's waiting queue: its queue wait was reported or its first token came.
    admitted: bool = False
    # Its replica preempted it back to the waiting queue (KV ran out) at the last stats read: it
    # holds no KV there and re-prefills its whole context when resumed, like a queued request.
    preempted: bool = False
    queued_since: float = 0.0  # when the current leg started (reset when it is sent)
    migrate_to: int | None = None
    migrated: bool = False  # the last stream ended because of a migration
    failures: int = 0  # replicas that failed under it
    deadline: float | None = None  # event-loop time it must end by
    first_token_at: float | None = None  # router clock at its first token, on whichever replica
    leg: InterruptibleStream | None = None  # the current replica stream, once open
    counted: RequestLoad | None = None  # what it adds to `counted_on`'s LoadTotals now
    counted_on: int | None = None
    prompt_blocks: PromptBlocks | None = None  # its prompt as prefix-cache blocks (prefix_locality.py)

    @property
    def adapter(self) -> str | None:
        return self.request.adapter.name if self.request.adapter else None

    @property
    def context_token_ids(self) -> tuple[int, ...]:
        """Its prompt and every token generated so far: what its KV covers."""
        return (*self.request.prompt_token_ids, *self.generated)

    def continuation(self) -> GenerateRequest:
        """The request to send after a move: the prompt grows by what was generated."""
        s = self.request.sampling
        n = len(self.generated)
        # A leg's first output gives the prompt's logprobs with its first token: once a token came, they
        # came, and this leg's prompt holds generated tokens too.
        prompt_logprobs = s.prompt_logprobs if n == 0 else None
        sampling = dataclasses.replace(
            s,
            max_tokens=s.max_tokens - n,
            min_tokens=max(0, s.min_tokens - n),
            prompt_logprobs=prompt_logprobs,
            generated_before=n,  # its grammar resumes after them; penalties and bad words see them
        )
        return dataclasses.replace(
            self.request,
            request_id=f"{self.request.request_id}-r{self.resubmissions}",
            prompt_token_ids=self.context_token_ids,
            sampling=sampling,
        )

    def load(self, lengths: OutputLengthEstimator | None = None) -> RequestLoad:
        """What the balancer sees; its output is expected from `lengths` (else max_tokens)."""
        n, cap = len(self.generated), self.request.sampling.max_tokens
        expected = lengths.expected_total(self.adapter, n, cap) if lengths is not None else cap
        return RequestLoad(
            request_id=self.request.request_id,
            adapter=self.adapter,
            prompt_tokens=len(self.request.prompt_token_ids),
            output_tokens=n,
            expected_output_tokens=expected,
            running=self.admitted and not self.preempted,
            queued_since=self.queued_since,
            arrival=self.arrival,
            adapter_bytes=self.request.adapter.size_bytes if self.request.adapter is not None else 0,
            max_tokens=cap,
        )

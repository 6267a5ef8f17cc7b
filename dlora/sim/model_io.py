"""What the replica model (`dlora.sim.replica_model`) takes and gives: a trace's jobs, the
replicas' limits and step costs, and what each job went through."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlora.cluster.prefix_locality import DEFAULT_BLOCK_TOKENS
from dlora.cost.params import CostParams
from dlora.sim.step_costs import StepCosts, preset
from dlora.slo.accounting import SloAccounting


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: arrival second, adapter, prompt tokens, the tokens it will generate."""

    arrival: float
    adapter: str
    prompt_len: int
    output_len: int
    max_tokens: int


@dataclass(frozen=True)
class ReplicaModel:
    max_running: int = 16  # vLLM max_num_seqs
    max_loras: int = 8  # distinct adapters in one step
    adapter_slots: int = 8  # adapters resident at once (max_cpu_loras)
    load_s: float = 0.02  # loading an absent adapter, paid by the step that admits it
    kv_blocks: int | None = None  # KV blocks per replica (None: KV never binds)
    block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per KV block
    costs: StepCosts = field(default_factory=lambda: preset("cpu-einsum"))

    def cost_params(self) -> CostParams:
        """The dispatch cost model's view of these costs (what fitting measured steps converges to)."""
        c = self.costs
        return CostParams(
            per_iteration_s=c.fixed_s + c.lora_fixed_s,
            per_decode_token_s=c.per_seq_s + c.lora_per_seq_s,
            per_prefill_token_s=c.per_prefill_token_s + c.lora_per_prefill_token_s,
            adapter_load_s=self.load_s,
            max_batch=self.max_running,
        )


@dataclass
class Outcome:
    queue_s: list[float]  # per job: arrival to first admission
    latency_s: list[float]  # per job: arrival to its last token
    preemptions: int
    moved: int = 0  # `balancer`: requests its planners moved (queued ones, and running ones in rounds)
    moved_running: int = 0  # of which running, by co-migration rounds
    ttft_s: list[float] = field(default_factory=list)  # per job: arrival to its first token
    tpot_s: list[float | None] = field(default_factory=list)  # per job: Aladdin's ATGT (None: one token)
    slo: SloAccounting | None = None  # every job judged against the SLO it was held to
    fairness_gaps: list[float] = field(default_factory=list)  # MuxServe's gap, per replica and period
    infeasible_dispatches: int = 0  # `slo_feasible` / `best_fit`: no replica met every check

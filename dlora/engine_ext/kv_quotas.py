"""MuxServe's per-adapter KV quotas applied to one engine's admissions (`scheduling.kv_quotas`).

Runs inside vLLM's EngineCore process (the scheduler calls it each step).

The quotas themselves are pure (`dlora.slo.kv_shares`): each active adapter's share of the KV
blocks, in proportion to its request rate over the last period, with unused quota lent out. Here
they meet vLLM's requests: blocks in use per adapter are its admitted requests' computed tokens in
blocks, a waiting request asks for its prompt's blocks, and each step the scheduler hides the
waiting requests the quotas refuse (borrowers first, and only when blocks are short), so a hot
adapter can no longer fill the cache and push every other adapter's requests out. The adapters
over their quota are the first vLLM preempts when blocks run out (the scheduler orders them last
by priority, which vLLM's preemption follows).

With quotas off the same bookkeeping still runs (`observe`), so the fairness gap is reported either
way and the two can be compared.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from dlora.slo.kv_shares import AdapterName, KvQuotas, blocks_for, plan_admissions


def _adapter(request) -> AdapterName:
    return request.lora_request.lora_name if request.lora_request else None


class EngineKvQuotas:
    def __init__(self, total_blocks: int, block_size: int, period_s: float, now: float) -> None:
        self.block_size = block_size
        self.quotas = KvQuotas(total_blocks, period_s, now)
        self.used: dict[AdapterName, int] = {}  # blocks in use per adapter at the last step

    def arrived(self, request) -> None:
        self.quotas.arrived(_adapter(request))

    def observe(self, admitted: Iterable, waiting: Sequence, now: float) -> None:
        """Record this step's blocks in use per adapter (from the `admitted` requests) and, at the
        end of a period, re-adapt the quotas. Also runs with quotas off, for the fairness gap."""
        used: dict[AdapterName, int] = {}
        for r in admitted:
            a = _adapter(r)
            used[a] = used.get(a, 0) + blocks_for(r.num_computed_tokens, self.block_size)
        self.used = used
        self.quotas.adapt(now, active={*used, *(_adapter(r) for r in waiting)})

    def refused(self, admitted: Iterable, waiting: Sequence, now: float) -> set[str]:
        """Ids of the `waiting` requests (in priority order) the quotas hold back this step, given
        the `admitted` requests' blocks."""
        self.observe(admitted, waiting, now)
        if not self.quotas.quotas:  # before the first period ends: every block is lent
            return set()
        asks = [(r.request_id, _adapter(r), blocks_for(r.num_prompt_tokens, self.block_size)) for r in waiting]
        plan = plan_admissions(asks, self.used, self.quotas.quotas, self.quotas.total_blocks)
        admitted_now = set(plan.admitted)
        return {rid for rid, _, _ in asks if rid not in admitted_now}

    def admissible(
        self, allowed: list[str], requests: Mapping[str, Any], running: Collection[str], enforce: bool, now: float
    ) -> list[str]:
        """`allowed` (request ids, in order) less the waiting requests the quotas hold back this step;
        with quotas off (`enforce` False) all of it, after recording the blocks in use for the
        fairness gap. `requests`: every unfinished request by id; `running`: the ids of those running."""
        waiting = [requests[i] for i in allowed if i not in running]
        admitted = [r for rid, r in requests.items() if rid in running]
        if not enforce:
            self.observe(admitted, waiting, now)
            return allowed
        refused = self.refused(admitted, waiting, now)
        kept = [i for i in allowed if i not in refused]
        return kept or allowed[:1]  # never an empty step while requests wait (the engine would spin)

    def borrowers(self) -> set[AdapterName]:
        """Adapters holding more blocks than their quota (preempted first)."""
        q = self.quotas.quotas
        return {a for a, u in self.used.items() if q and u > q.get(a, 0)}

    def fairness_gap(self) -> float:
        """MuxServe's max |R_a - R_b| (R = blocks used / request rate) at the last step."""
        return self.quotas.fairness_gap(self.used)

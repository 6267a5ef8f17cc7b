"""KV blocks on a modelled replica, and MuxServe's per-adapter quotas over them (`slo.kv_quotas`).

What each request needs for its next step (its context and the token it generates, in blocks of
`block_tokens`), what its replica has free and what each adapter's running requests hold, and what
the quotas decide from those: who borrows beyond its quota, which queued requests may start
(`plan_admissions`) and which running ones a request within its quota takes blocks back from. The
replica model (`replica_model.py`) preempts and admits by these answers; the quotas themselves
(`KvQuotas`, one per replica) are metered there in every configuration, for the fairness gap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dlora.sim.model_io import ReplicaModel, TraceRequest
from dlora.slo.kv_shares import AdapterName, KvQuotas, plan_admissions


class ReplicaKv:
    def __init__(
        self, jobs: Sequence[TraceRequest], generated: list[int], model: ReplicaModel, quotas_decide: bool
    ) -> None:
        """`generated`: each job's tokens so far, the replica model's own list (read, never written);
        `quotas_decide`: the quotas hold borrowers back (`slo.kv_quotas`), else they only measure."""
        self.jobs, self.generated, self.model = jobs, generated, model
        self.quotas_decide = quotas_decide

    def blocks(self, i: int) -> int:
        """KV blocks request i needs for its next step (its context and the token it generates)."""
        return -(-(self.jobs[i].prompt_len + self.generated[i] + 1) // self.model.block_tokens)

    def free(self, running: list[int]) -> float:
        """Blocks free on a replica running `running` (infinite when KV never binds)."""
        if self.model.kv_blocks is None:
            return float("inf")
        return self.model.kv_blocks - sum(self.blocks(i) for i in running)

    def used(self, running: list[int]) -> dict[AdapterName, int]:
        """KV blocks each adapter's running requests hold (for their next step)."""
        used: dict[AdapterName, int] = {}
        for i in running:
            a = self.jobs[i].adapter
            used[a] = used.get(a, 0) + self.blocks(i)
        return used

    def quotas_set(self, quotas: KvQuotas) -> dict[AdapterName, int]:
        """The replica's quotas when they decide (`kv_quotas` on and a period has set them), else {}."""
        return quotas.quotas if self.quotas_decide else {}

    def borrowers(self, running: list[int], quotas: KvQuotas) -> set[AdapterName]:
        """Adapters holding more KV blocks here than their quota (none without quotas)."""
        limits = self.quotas_set(quotas)
        return {a for a, u in self.used(running).items() if limits and u > limits.get(a, 0)}

    def startable(self, running: list[int], quotas: KvQuotas, ordered: list[int]) -> list[int]:
        """`ordered` less the requests the quotas refuse, in the order they start: with quotas set,
        `plan_admissions`' (those within their adapter's quota first, then borrowers while blocks
        are free); otherwise all of them, as they are."""
        limits = self.quotas_set(quotas)
        if not limits:
            return ordered
        asks = [(str(i), self.jobs[i].adapter, self.blocks(i)) for i in ordered]
        plan = plan_admissions(asks, self.used(running), limits, quotas.total_blocks)
        return [int(i) for i in plan.admitted]

    def to_reclaim(
        self, running: list[int], quotas: KvQuotas, i: int, order_key: Callable[[int], tuple]
    ) -> list[int] | None:
        """MuxServe's take-back for request i, within its quota but short of free blocks: the
        borrowers' running requests `KvQuotas.admit` names, to preempt in this order (each
        adapter's last in `order_key` first) until i fits. None when the quotas give it nothing
        to take back."""
        if not self.quotas_set(quotas):
            return None
        ans = quotas.admit(self.jobs[i].adapter, self.blocks(i), self.used(running))
        if not ans.reclaim:
            return None
        victims: list[int] = []
        for adapter, blocks in ans.reclaim.items():
            mine = sorted((j for j in running if self.jobs[j].adapter == adapter), key=order_key)
            while blocks > 0 and mine:
                victim = mine.pop()
                blocks -= self.blocks(victim)
                victims.append(victim)
        return victims

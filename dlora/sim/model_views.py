"""The modelled replicas as the server's policies see replicas: `ReplicaView`s of `RequestLoad`s.

Built from the replica model's state (`replica_model.py`), so the real dispatch (`ProactiveDispatch`,
the SLO-aware `feasible_dispatch`) and the balancer's planners run on the model unchanged. A
request's expected length is the estimator's (as the server's router has it), or its true one with
`oracle_lengths`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.policy_views import ReplicaView, RequestLoad
from dlora.sim.model_io import ReplicaModel, TraceRequest
from dlora.sim.sim_replica import SimReplica


class ModelViews:
    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        generated: list[int],
        sent_at: list[float],
        model: ReplicaModel,
        estimator: OutputLengthEstimator,
        oracle_lengths: bool,
    ) -> None:
        """`generated`, `sent_at`: each job's tokens so far and when its current replica got it, the
        replica model's own lists (read, never written)."""
        self.jobs, self.generated, self.sent_at = jobs, generated, sent_at
        self.model, self.estimator, self.oracle = model, estimator, oracle_lengths

    def view(self, r: SimReplica, kv_free: float, now: float) -> ReplicaView:
        """Replica `r` at `now`, with `kv_free` blocks free."""
        requests = tuple(self.load(i, True) for i in r.running) + tuple(self.load(i, False) for i in r.queue)
        m = self.model
        kv = 0.0 if m.kv_blocks is None else 1 - kv_free / m.kv_blocks
        capacity = 1 << 20 if m.kv_blocks is None else m.kv_blocks * m.block_tokens
        return ReplicaView(
            r.rid,
            requests,
            resident_adapters=frozenset(r.resident),
            kv_usage=kv,
            kv_capacity_tokens=capacity,
            adapter_slots=m.adapter_slots,
            batch_adapter_slots=m.max_loras,
            max_running=m.max_running,
            step_left_s=max(0.0, r.step_ends - now) if r.busy else 0.0,
        )

    def load(self, i: int, running: bool) -> RequestLoad:
        """Request i as dispatch and the planners see it (its dispatch id is `r<i>`)."""
        job, generated = self.jobs[i], self.generated[i]
        expected = (
            float(job.output_len)
            if self.oracle
            else self.estimator.expected_total(job.adapter, generated, job.max_tokens)
        )
        return RequestLoad(
            f"r{i}",
            job.adapter,
            job.prompt_len,
            generated,
            expected,
            running,
            queued_since=self.sent_at[i],
            arrival=job.arrival,
        )

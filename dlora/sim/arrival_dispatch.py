"""Dispatch at arrival in the replica model: the server's own policies over the modelled replicas' views.

`slo.dispatch` picks the policy: `least_pending` is the real `ProactiveDispatch` (with the
discipline's start slack: None is dLoRA's pending time alone); the others are the SLO-aware
`feasible_dispatch`, which judges each replica against the request's SLO (`SloAccounting.slo_of`)
and counts the dispatches where no replica met every check.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlora.cluster import feasible_dispatch
from dlora.cluster.dispatch import ProactiveDispatch
from dlora.cluster.policy_views import ReplicaView, RequestLoad
from dlora.cost.params import CostParams
from dlora.sim.model_io import TraceRequest
from dlora.slo.accounting import SloAccounting
from dlora.slo.config import SloConfig


class ArrivalDispatch:
    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        slo: SloConfig,
        params: CostParams,
        accounting: SloAccounting,
        start_slack_s: float | None,
    ) -> None:
        self.slo, self.params = slo, params
        self.dispatch = ProactiveDispatch(start_slack_s=start_slack_s)
        # each request's SLO, by its dispatch id (fixed by its adapter and prompt; dispatch asks often)
        self.slo_by_id = {f"r{i}": accounting.slo_of(j.adapter, j.prompt_len) for i, j in enumerate(jobs)}
        self.infeasible = 0  # SLO-aware dispatches where no replica met every check

    def choose(
        self,
        t: float,
        views: list[ReplicaView],
        running: Sequence[list[int]],
        req: RequestLoad,
        first_token: dict[int, float],
    ) -> int:
        """The replica `req` goes to at `t`, among `views` (`running`: each one's running requests;
        `first_token`: when each request's first token came). Raises NoEligibleReplica."""
        if self.slo.dispatch == "least_pending":
            return self.dispatch.choose(views, req, {v.replica_id: self.params for v in views}).replica_id
        slo_replicas = [
            feasible_dispatch.SloReplica(v, self.params, {f"r{j}": t - first_token[j] for j in ids if j in first_token})
            for v, ids in zip(views, running)
        ]
        got = feasible_dispatch.choose(
            slo_replicas,
            req,
            lambda x: self.slo_by_id[x.request_id],
            t,
            self.slo.dispatch,
            self.slo.gamma,
            self.slo.theta,
        )
        self.infeasible += not got.feasible
        return got.replica_id

"""The skew benchmark's workloads through the replica simulator: policies side by side.

`bench/dynamic_batching_skew` sends the same workloads (one replica, 8 adapters, Poisson
arrivals, 64 prompt / 64 output tokens, `skewed` popularity from uniform to one adapter taking
>= 90%) to real servers; this runs them through `BatchingSim` with the real policy objects, so a
policy change can be judged in seconds, over many seeds, in several cost regimes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from dlora.bench.popularity import popularity_shares
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.scheduling import BatchingConfig, make_policy
from dlora.sim.batching_sim import BatchingSim, SimRequest, SimResult
from dlora.sim.step_costs import StepCosts

NUM_ADAPTERS = 8


@dataclass(frozen=True)
class SkewWorkload:
    alpha: float  # `skewed` popularity: adapter a gets alpha^-a of the requests
    rate: float = 1.0
    num_prompts: int = 56
    input_len: int = 64
    output_len: int = 64
    seed: int = 0

    @property
    def top_share(self) -> float:
        return float(popularity_shares("skewed", NUM_ADAPTERS, self.alpha)[0])

    def requests(self) -> list[SimRequest]:
        spec = WorkloadSpec(
            num_prompts=self.num_prompts,
            adapters=tuple(f"a{i}" for i in range(NUM_ADAPTERS)),
            distribution="skewed",
            alpha=self.alpha,
            input_len=self.input_len,
            output_len=self.output_len,
            request_rate=self.rate,
            max_model_len=4096,
            seed=self.seed,
        )
        return [
            SimRequest(r.request_id, r.adapter, r.arrival_time, r.prompt_len, r.output_len)
            for r in generate_workload(spec, with_prompts=False)
        ]


def simulate(
    policy: str,
    config: BatchingConfig,
    costs: StepCosts,
    requests: Iterable[SimRequest],
    noise_sd: float = 0.0,
    seed: int = 0,
    warm_up: Iterable[SimRequest] = (),
    **engine,
) -> SimResult:
    """`requests` through one replica; `warm_up` first, untimed, on the same policy and engine (a
    server that has run before: what the policy learned carries over). The result's times are
    those of `requests`' own arrival clock."""
    sim = BatchingSim(
        make_policy(policy, config), costs, noise_sd=noise_sd, seed=seed, mixed=config.mixed_merged, **engine
    )
    warm = list(warm_up)
    if not warm:
        return sim.run(requests)
    offset = max(r.finished_at for r in sim.run(warm).requests) + 1.0
    shifted = [dataclasses.replace(r, arrival=r.arrival + offset) for r in requests]
    result = sim.run(shifted)
    result.requests[:] = [
        dataclasses.replace(
            r, arrival=r.arrival - offset, first_token_at=r.first_token_at - offset, finished_at=r.finished_at - offset
        )
        for r in result.requests
    ]
    return result

"""Output-length estimator (hand-worked values) and its use by dispatch and the migration problem."""

from __future__ import annotations

import pytest

from dlora.cluster.dispatch import ProactiveDispatch
from dlora.cluster.estimators.output_lengths import OutputLengthConfig, OutputLengthEstimator
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.migration.problem import MigrationConfig, build_problem
from dlora.cluster.policy_views import ClusterView
from dlora.cluster.router import RequestState
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from tests.cluster.balancer_factories import make_replica


def fed(lengths: dict, **cfg) -> OutputLengthEstimator:
    est = OutputLengthEstimator(OutputLengthConfig(**({"min_samples": 2} | cfg)))
    for adapter, ls in lengths.items():
        for n in ls:
            est.observe(adapter, n)
    return est


def test_expected_length_of_a_new_request_is_the_mean_capped_per_sample():
    est = fed({"a": [10, 20, 30, 100]})
    assert est.expected_remaining("a", 0, 1000) == pytest.approx(40.0)  # (10+20+30+100)/4
    # E[min(L, 50)] = (10+20+30+50)/4, not min(E[L], 50) = 40
    assert est.expected_remaining("a", 0, 50) == pytest.approx(27.5)
    assert est.expected_total("a", 0, 5) == pytest.approx(5.0)  # every sample beyond the cap


def test_remaining_is_conditional_on_the_tokens_already_generated():
    est = fed({"a": [10, 20, 30, 100]})
    # g=15: survivors 20, 30, 100 -> mean 50 -> 35 more
    assert est.expected_remaining("a", 15, 1000) == pytest.approx(35.0)
    assert est.expected_total("a", 15, 1000) == pytest.approx(50.0)
    # g=20: a length equal to g has ended, survivors 30, 100 -> 65 - 20 = 45
    assert est.expected_remaining("a", 20, 1000) == pytest.approx(45.0)
    # cap 60 at g=25: survivors 30, min(100, 60) -> 45 - 25 = 20
    assert est.expected_remaining("a", 25, 60) == pytest.approx(20.0)
    # at the cap nothing remains; one short of it, at most one token
    assert est.expected_remaining("a", 60, 60) == 0.0
    assert est.expected_remaining("a", 59, 60) == pytest.approx(1.0)


def test_a_request_longer_than_its_history_expects_as_many_tokens_again_up_to_its_cap():
    est = fed({"a": [10, 20]})
    assert est.expected_remaining("a", 40, 1000) == pytest.approx(40.0)
    assert est.expected_remaining("a", 40, 50) == pytest.approx(10.0)
    # ... unless another adapter's requests ran that long: then the pooled history answers
    est.observe("b", 100)
    assert est.expected_remaining("a", 40, 1000) == pytest.approx(60.0)


def test_cold_start_uses_the_pooled_lengths_then_the_prior():
    est = OutputLengthEstimator(OutputLengthConfig(min_samples=3))
    assert est.expected_remaining("a", 0, 256) == 256.0  # no prior: the max_tokens cap
    assert est.expected_remaining("a", 10, 256) == 246.0
    prior = OutputLengthEstimator(OutputLengthConfig(min_samples=3, prior_tokens=64))
    assert prior.expected_remaining("a", 0, 256) == 64.0
    assert prior.expected_remaining("a", 100, 256) == 64.0  # memoryless
    assert prior.expected_remaining("a", 0, 16) == 16.0
    est.observe("b", 10)
    est.observe("b", 30)
    assert est.expected_remaining("a", 0, 256) == pytest.approx(20.0)  # pooled: b's lengths
    for n in (100, 100, 100):
        est.observe("a", n)
    assert est.expected_remaining("a", 0, 256) == pytest.approx(100.0)  # a's own from min_samples on
    assert est.expected_remaining("c", 0, 256) == pytest.approx((10 + 30 + 300) / 5)  # still pooled


def test_window_keeps_the_last_lengths_and_zero_disables_the_estimate():
    est = fed({"a": [1000, 10, 20, 30]}, window=3)
    assert est.samples("a") == [10, 20, 30]
    assert est.expected_remaining("a", 0, 2000) == pytest.approx(20.0)
    off = fed({"a": [10, 10, 10]}, window=0)
    assert off.expected_remaining("a", 0, 256) == 256.0 and off.samples("a") == []


def test_pooled_samples_are_every_adapters_last_lengths_in_order():
    est = OutputLengthEstimator(OutputLengthConfig(window=3))
    for adapter, n in (("a", 1), ("b", 2), ("a", 3), ("b", 4)):
        est.observe(adapter, n)
    assert est.pooled_samples() == [2, 3, 4] and est.samples("a") == [1, 3]


def test_config_rejects_bad_values():
    for bad in ({"window": -1}, {"min_samples": 0}, {"prior_tokens": 0}):
        with pytest.raises(ValueError):
            OutputLengthConfig(**bad)


def state(rid: str, adapter: str, generated: int, max_tokens: int = 256) -> RequestState:
    req = GenerateRequest(rid, (1,) * 20, SamplingSpec(max_tokens=max_tokens), AdapterRef(adapter, len(adapter), "/x"))
    return RequestState(req, arrival=0.0, generated=[7] * generated, admitted=generated > 0)  # generating there


def test_router_load_uses_the_estimate_and_max_tokens_without_one():
    est = fed({"short": [10, 10], "long": [200, 200]})
    assert state("r", "short", 5).load().expected_output_tokens == 256
    assert state("r", "short", 5).load(est).expected_output_tokens == pytest.approx(10.0)
    assert state("r", "long", 5).load(est).remaining_output_tokens == pytest.approx(195.0)
    assert state("q", "long", 0).load(est).expected_output_tokens == pytest.approx(200.0)


def test_dispatch_prefers_the_replica_whose_requests_finish_sooner_under_equal_max_tokens():
    est = fed({"short": [8, 12], "long": [180, 220]})
    views = lambda lengths: [  # noqa: E731
        make_replica(0, [state(f"l{i}", "long", 5).load(lengths) for i in range(4)], resident={"long", "new"}),
        make_replica(1, [state(f"s{i}", "short", 5).load(lengths) for i in range(4)], resident={"short", "new"}),
    ]
    new = state("n", "new", 0)
    params = {0: CostParams(), 1: CostParams()}
    # priced at max_tokens both replicas carry the same work: the tie goes to replica 0
    assert ProactiveDispatch().choose(views(None), new.load(), params).replica_id == 0
    d = ProactiveDispatch().choose(views(est), new.load(est), params)
    assert d.replica_id == 1 and not d.load_adapter


def test_migration_problem_prices_requests_by_the_estimate():
    est = fed({"short": [10, 10], "long": [200, 200]})
    p = CostParams()
    per_token = p.per_decode_token_s + p.per_iteration_s / p.max_batch
    busy = make_replica(
        0,
        [state(f"l{i}", "long", 50).load(est) for i in range(3)] + [state("s0", "short", 5).load(est)],
        resident={"long", "short"},
    )
    idle = make_replica(1, [], resident={"long", "short"})
    prob = build_problem(ClusterView((busy, idle)), {0: p, 1: p}, MigrationConfig())
    assert prob.load[0] == pytest.approx((3 * 150 + 5) * per_token)
    work = {g.adapter: g.work[0] for g in prob.groups}
    assert work["long"] == pytest.approx([150 * per_token] * 3)
    assert work["short"] == pytest.approx([5 * per_token])


def test_the_lengths_an_estimate_draws_on_are_the_adapters_own_once_it_has_enough():
    est = OutputLengthEstimator(OutputLengthConfig(min_samples=2))
    assert est.lengths_for("a") == []
    est.observe("b", 7)
    assert est.lengths_for("a") == [7]  # pooled until "a" has min_samples of its own
    est.observe("a", 3)
    assert sorted(est.lengths_for("a")) == [3, 7]
    est.observe("a", 5)
    assert sorted(est.lengths_for("a")) == [3, 5]
    assert OutputLengthEstimator(OutputLengthConfig(window=0)).lengths_for("a") == []


def test_each_length_keeps_whether_its_request_ended_by_itself():
    est = OutputLengthEstimator(OutputLengthConfig(min_samples=2, window=3))
    est.observe("b", 9, ended=False)  # stopped at its cap
    for n, ended in ((3, True), (64, False), (5, True)):
        est.observe("a", n, ended)
    h = est.history(["a", "c"])
    assert h.own == {"a": ((3, True), (64, False), (5, True)), "c": ()}
    assert h.pooled == ((3, True), (64, False), (5, True))  # the window (3) keeps the last three
    assert h.uses_own("a") and not h.uses_own("c") and h.min_samples == 2
    est.observe("a", 7)
    assert est.history(["a"]).own["a"] == ((64, False), (5, True), (7, True))  # the oldest is dropped
    assert [n for n, _ in est.history(["a"]).own["a"]] == est.lengths_for("a")
    assert OutputLengthEstimator(OutputLengthConfig(window=0)).history(["a"]).own == {"a": ()}

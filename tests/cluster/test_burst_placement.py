import math

import pytest

from dlora.cluster.placement import AdapterDemand, PlacementReplica, burst_tolerance, plan_placement


def test_greedy_replication_raises_the_minimum_burst_tolerance_on_a_crafted_case():
    # free memory: r0 800, r1 900, r2 600 tokens; 100 tokens per request.
    # hot: 8 req / 10 req/s = 0.8 s. Copy to r1 -> (8 + 8) / 10 = 1.6 (r2 would give 1.3);
    # then to r2 -> (8 + 8 + 5) / 10 = 2.1; cold adapters drop to 8 but stay above; no replica left.
    replicas = [
        PlacementReplica(0, 1000, 300, frozenset({"hot", "c1"})),
        PlacementReplica(1, 1000, 300, frozenset({"c2"})),
        PlacementReplica(2, 600, 300),
    ]
    demands = [AdapterDemand("hot", 10.0, 100), AdapterDemand("c1", 1.0, 100), AdapterDemand("c2", 1.0, 100)]
    before = min(burst_tolerance({0: {"hot", "c1"}, 1: {"c2"}, 2: set()}, replicas, demands, 100).values())
    plan = plan_placement(replicas, demands, tokens_per_request=100)
    after = min(burst_tolerance(plan.placement, replicas, demands, 100).values())
    assert before < after
    assert (plan.min_tolerance_before, plan.min_tolerance_after) == pytest.approx((0.8, 2.1))
    assert plan.loads == (("hot", 1), ("hot", 2))
    assert plan.placement == {0: {"hot", "c1"}, 1: {"hot", "c2"}, 2: {"hot"}}


def test_stops_when_a_copy_would_lower_the_minimum():
    # Copying a onto r1 leaves r1 100 free tokens: a rises to 3 but b falls to 1 < 2.
    replicas = [PlacementReplica(0, 300, 300, frozenset({"a"})), PlacementReplica(1, 300, 300, frozenset({"b"}))]
    demands = [AdapterDemand("a", 1.0, 100), AdapterDemand("b", 1.0, 100)]
    plan = plan_placement(replicas, demands, 100)
    assert plan.loads == ()
    assert plan.min_tolerance_before == plan.min_tolerance_after == pytest.approx(2.0)


def test_unplaced_adapters_are_placed_first_within_the_budget_and_idle_ones_never():
    replicas = [PlacementReplica(0, 1000, 100, frozenset({"a"})), PlacementReplica(1, 1000, 200)]
    demands = [AdapterDemand("a", 1.0, 100), AdapterDemand("new", 5.0, 100), AdapterDemand("idle", 0.0, 100)]
    plan = plan_placement(replicas, demands, 100)
    # "new" (placed nowhere, tolerance 0) goes to r1, the only replica with budget left; it is
    # then the minimum (900 / 100 / 5 = 1.8) and cannot be copied again: r0's budget is full.
    assert plan.min_tolerance_before == 0.0
    assert plan.loads == (("new", 1),)
    assert plan.min_tolerance_after == pytest.approx(1.8)
    assert plan.placement == {0: {"a"}, 1: {"new"}}


def test_no_traffic_means_nothing_to_do():
    plan = plan_placement([PlacementReplica(0, 100, 100)], [AdapterDemand("a", 0.0, 10)], 10)
    assert plan.loads == () and plan.min_tolerance_before == math.inf
    with pytest.raises(ValueError):
        plan_placement([], [], 0)

import dataclasses

import pytest

from dlora.cluster.estimators.replica_cost import (
    MIN_SAMPLES,
    CostParams,
    ReplicaCostModel,
    batch_slot_wait,
    load_time,
    pending_time,
    recompute_s,
    request_work,
)
from dlora.cluster.policy_views import IterationSample
from tests.cluster.balancer_factories import make_replica, make_request

P = CostParams(per_iteration_s=0.0032, per_decode_token_s=0.001, per_prefill_token_s=0.0002, max_batch=32)


def test_request_work_counts_prefill_only_while_queued_and_discounts_merged():
    per_token = 0.001 + 0.0032 / 32
    queued = make_request("q", prompt=100, expected=50)
    running = make_request("r", prompt=100, output=20, expected=50, running=True)
    assert request_work(P, queued) == pytest.approx(100 * 0.0002 + 50 * per_token)
    assert request_work(P, running) == pytest.approx(30 * per_token)
    assert request_work(P, running, merged=True) == pytest.approx(0.6 * 30 * per_token)
    assert recompute_s(P, running) == pytest.approx(120 * 0.0002)
    assert recompute_s(P, queued) == 0.0


def test_pending_time_sums_requests_with_the_merged_discount_and_load_time_only_if_absent():
    reqs = [make_request("1", "a", running=True, output=10), make_request("2", "b", running=True, output=10)]
    plain = make_replica(0, reqs, resident={"a", "b"})
    merged = make_replica(0, reqs, resident={"a", "b"}, merged_adapter="a")
    total = sum(request_work(P, r) for r in reqs)
    assert pending_time(P, plain) == pytest.approx(total)
    assert pending_time(P, merged) == pytest.approx(total - 0.4 * request_work(P, reqs[0]))
    assert load_time(P, plain, "a") == 0.0 and load_time(P, plain, None) == 0.0
    assert load_time(P, plain, "z") == P.adapter_load_s


def test_batch_slot_wait_is_the_first_in_use_adapter_to_drain_only_when_every_slot_is_taken():
    # Four adapters hold the four batch slots; "c" has the shortest longest-remaining request (30).
    reqs = [
        make_request("b0", "b", output=10, expected=100, running=True),
        make_request("b1", "b", output=90, expected=100, running=True),  # b's longest: 90 left
        make_request("c0", "c", output=20, expected=50, running=True),  # c: 30 left
        make_request("d0", "d", expected=70),  # queued, 70 left
        make_request("e0", "e", output=5, expected=45, running=True),
    ]  # 40 left
    full = make_replica(0, reqs, resident={"a", "b", "c", "d", "e"}, batch_adapter_slots=4)
    step = P.per_iteration_s + P.per_decode_token_s * len(reqs)
    assert batch_slot_wait(P, full, "a") == pytest.approx(30 * step)
    for in_use in ("b", "c", "d", "e"):
        assert batch_slot_wait(P, full, in_use) == 0.0  # joins its own adapter's slot
    assert batch_slot_wait(P, full, None) == 0.0  # the base model needs no slot
    roomy = make_replica(0, reqs, resident={"a", "b", "c", "d", "e"}, batch_adapter_slots=5)
    assert batch_slot_wait(P, roomy, "a") == 0.0
    assert batch_slot_wait(P, make_replica(0, reqs), "a") == 0.0  # default: no batch-slot limit


def test_fit_recovers_step_coefficients_from_varied_steps():
    true = (0.003, 0.0008, 0.00015)
    model = ReplicaCostModel(CostParams())
    for i in range(64):
        decode, prefill = 1 + (i * 7) % 32, (i * 37) % 300
        t = true[0] + true[1] * decode + true[2] * prefill
        model.observe(IterationSample(num_seqs=decode, prefill_tokens=prefill, decode_tokens=decode, seconds=t))
    got = model.params
    assert got.per_iteration_s == pytest.approx(true[0], rel=0.05)
    assert got.per_decode_token_s == pytest.approx(true[1], rel=0.05)
    assert got.per_prefill_token_s == pytest.approx(true[2], rel=0.05)


def test_fit_with_a_single_step_shape_stays_nonnegative_and_predicts_it():
    model = ReplicaCostModel(CostParams())
    for _ in range(20):
        model.observe(IterationSample(num_seqs=16, prefill_tokens=0, decode_tokens=16, seconds=0.05))
    p = model.params
    assert min(p.per_iteration_s, p.per_decode_token_s, p.per_prefill_token_s) >= 0
    assert p.per_iteration_s + 16 * p.per_decode_token_s == pytest.approx(0.05, rel=0.1)


def test_priors_hold_until_enough_samples_and_merged_ratio_is_measured():
    model = ReplicaCostModel(P)
    model.observe(IterationSample(8, 0, 8, 0.02))
    assert model.params == P and not model.measured and not model.merged_measured
    for i in range(16):
        n = 4 + i
        model.observe(IterationSample(n, 0, n, 0.0032 + 0.001 * n))
        model.observe(IterationSample(n, 0, n, 0.5 * (0.0032 + 0.001 * n), merged=True))
    assert model.params.merged_ratio == pytest.approx(0.5, rel=0.05) and model.measured and model.merged_measured


def test_merged_steps_alone_measure_the_replica_through_the_prior_ratio():
    # A replica that has only run merged: its merged steps are predicted as measured (twice the
    # priors' cost here), its unmerged ones through the prior ratio (0.6), until unmerged steps come.
    model = ReplicaCostModel(P)
    for i in range(MIN_SAMPLES - 1):
        n = 4 + i
        model.observe(IterationSample(n, 0, n, 2 * 0.6 * (0.0032 + 0.001 * n), merged=True))
    assert not model.measured and model.params.per_decode_token_s == P.per_decode_token_s
    model.observe(IterationSample(20, 0, 20, 2 * 0.6 * (0.0032 + 0.001 * 20), merged=True))
    assert model.measured
    p = model.params
    assert p.merged_ratio == P.merged_ratio
    assert p.per_iteration_s + 10 * p.per_decode_token_s == pytest.approx(2 * (0.0032 + 0.01), rel=0.02)
    for i in range(MIN_SAMPLES):
        n = 4 + i
        model.observe(IterationSample(n, 0, n, 0.0032 + 0.001 * n))
    p = model.params  # unmerged steps now fix the scale and the merged ones the ratio: 1.2
    assert p.per_decode_token_s == pytest.approx(0.001, rel=0.05)
    assert p.merged_ratio == pytest.approx(1.2, rel=0.05)


def test_merged_steps_alone_leave_the_ratio_unmeasured_and_a_new_prior_keeps_their_cost():
    # Merged steps of a replica that ran no unmerged ones fix its scale, not its merged/unmerged
    # ratio: a caller with a better prior ratio gets it, and the merged steps are still predicted
    # at their measured cost (the unmerged coefficients move instead).
    model = ReplicaCostModel(P)
    for i in range(MIN_SAMPLES):
        n = 4 + i
        model.observe(IterationSample(n, 0, n, 0.6 * (0.0032 + 0.001 * n), merged=True))
    assert model.measured and not model.merged_measured
    p = model.params_with_ratio(0.3)
    assert p.merged_ratio == 0.3
    assert 0.3 * (p.per_iteration_s + 10 * p.per_decode_token_s) == pytest.approx(0.6 * 0.0132, rel=0.02)
    assert p.per_decode_token_s == pytest.approx(2 * model.params.per_decode_token_s)
    for i in range(MIN_SAMPLES - 1):  # unmerged steps, not yet enough to fit
        model.observe(IterationSample(4 + i, 0, 4 + i, 0.0032 + 0.001 * (4 + i)))
    assert not model.merged_measured
    model.observe(IterationSample(20, 0, 20, 0.0032 + 0.02))
    assert model.merged_measured  # now the ratio is fitted, and no prior replaces it
    assert model.params_with_ratio(0.3) == model.params
    assert model.params.merged_ratio == pytest.approx(0.6, rel=0.05)


def test_unmerged_steps_alone_take_a_new_prior_ratio_as_it_is():
    model = ReplicaCostModel(P)
    model.observe(*(IterationSample(n, 0, n, 0.0032 + 0.001 * n) for n in range(4, 4 + MIN_SAMPLES)))
    model.observe(*(IterationSample(n, 0, n, 0.5 * (0.0032 + 0.001 * n), merged=True) for n in (4, 8)))
    assert model.measured and not model.merged_measured  # 2 merged steps: fewer than MIN_MERGED_SAMPLES
    assert model.params_with_ratio(0.3) == dataclasses.replace(model.params, merged_ratio=0.3)


def test_invalid_params_are_rejected():
    with pytest.raises(ValueError):
        CostParams(per_decode_token_s=-1)
    with pytest.raises(ValueError):
        CostParams(max_batch=0)


def test_the_load_price_is_an_average_of_the_measured_loads_and_survives_refits():
    model = ReplicaCostModel(P)
    assert model.params.adapter_load_s == P.adapter_load_s  # nothing measured: the prior
    model.observe_load(0.5)
    assert model.params.adapter_load_s == pytest.approx(0.5)  # the first load replaces the prior
    model.observe_load(0.1)
    assert model.params.adapter_load_s == pytest.approx(0.7 * 0.5 + 0.3 * 0.1)
    model.observe_load(-1.0)  # a clock that went backwards says nothing
    assert model.params.adapter_load_s == pytest.approx(0.38)
    model.observe(*(IterationSample(n, 0, n, 0.03 + 0.002 * n, False) for n in (2, 4, 8, 16) * 3))
    assert model.params.per_decode_token_s == pytest.approx(0.002, rel=0.05)  # refitted ...
    assert model.params.adapter_load_s == pytest.approx(0.38)  # ... and the load price kept
    assert load_time(model.params, make_replica(0, [], resident=set()), "z") == pytest.approx(0.38)

"""The migration bound's replica model and both disciplines, on traces worked out by hand."""

import pytest

from dlora.sim.migration_bound import ReplicaModel, TraceRequest, bound, queue_delays, simulate
from dlora.sim.step_costs import StepCosts


def step_costs(fixed_s: float = 1.0, per_seq_s: float = 0.0, per_prefill_token_s: float = 0.0) -> StepCosts:
    """Steps without a LoRA term: `fixed_s` + `per_seq_s` a sequence + `per_prefill_token_s` a prompt token."""
    zero = {"lora_fixed_s": 0.0, "lora_per_seq_s": 0.0, "lora_per_prefill_token_s": 0.0}
    return StepCosts(fixed_s=fixed_s, per_seq_s=per_seq_s, per_prefill_token_s=per_prefill_token_s, **zero)


ONE_SECOND_STEPS = step_costs()


def model(**kw) -> ReplicaModel:
    kw = {"max_running": 1, "max_loras": 8, "adapter_slots": 8, "load_s": 0.0, "costs": ONE_SECOND_STEPS, **kw}
    return ReplicaModel(**kw)


def job(at: float, length: int, adapter: str = "x", cap: int = 10) -> TraceRequest:
    return TraceRequest(at, adapter, prompt_len=4, output_len=length, max_tokens=cap)


@pytest.mark.parametrize("discipline", ["at_arrival", "late_binding"])
def test_one_slot_serves_in_arrival_order(discipline):
    # each request needs 2 one-second steps; the second starts when the first ends
    assert queue_delays([job(0, 2), job(0, 2), job(0.5, 1)], 1, model(), discipline) == [0.0, 2.0, 3.5]


def test_dispatch_at_arrival_commits_where_late_binding_waits_for_the_first_free_slot():
    # A (10 tokens) and B (1 token) start on replicas 0 and 1 at t=0. When C arrives at t=0.5,
    # nothing has finished, so both look the same to dispatch (each running request expected to
    # run to its cap): the tie goes to replica 0, where C waits for A until t=10. Late binding
    # starts C when B's replica frees at t=1; dispatch knowing the true lengths sends it there too.
    jobs = [job(0, 10), job(0, 1), job(0.5, 1)]
    assert queue_delays(jobs, 2, model(), "at_arrival") == [0.0, 0.0, 9.5]
    assert queue_delays(jobs, 2, model(), "late_binding") == [0.0, 0.0, 0.5]
    assert queue_delays(jobs, 2, model(), "at_arrival", oracle_lengths=True) == [0.0, 0.0, 0.5]
    got = bound(jobs, 2, model())
    assert got["mean_queue_s"]["at_arrival"] == pytest.approx(9.5 / 3)
    assert got["gain_of_late_binding"] == pytest.approx(19.0)


def test_moves_take_a_request_queued_elsewhere_once_it_has_waited_long_enough():
    # the trace above: C is dispatched behind A on replica 0. Movable from t=0.6, it starts when
    # B's replica frees at t=1; movable only from t=2.5, it starts then on that idle replica.
    jobs = [job(0, 10), job(0, 1), job(0.5, 1)]
    assert queue_delays(jobs, 2, model(), "moves", move_after_s=0.1) == [0.0, 0.0, 0.5]
    assert queue_delays(jobs, 2, model(), "moves", move_after_s=2.0) == [0.0, 0.0, 2.0]
    got = bound(jobs, 2, model())
    assert got["gain_of_moves"] == pytest.approx(19.0)
    assert got["gain_of_balancer"] == pytest.approx(9.5 / 0.5)  # C moves at the t=1.0 tick (see below)
    assert got["best_gain"] == pytest.approx(19.0)


@pytest.mark.parametrize("discipline", ["at_arrival", "late_binding"])
def test_a_step_runs_at_most_max_loras_adapters_and_skips_the_rest(discipline):
    jobs = [job(0, 1, "x"), job(0, 1, "y"), job(0, 1, "x")]
    assert queue_delays(jobs, 1, model(max_running=2, max_loras=1), discipline) == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("discipline", ["at_arrival", "late_binding"])
def test_an_adapter_in_use_is_not_evicted_for_another(discipline):
    # one adapter slot: y can load only once x's request has finished (at_arrival: the router holds it)
    jobs = [job(0, 1, "x"), job(0, 1, "y")]
    assert queue_delays(jobs, 1, model(max_running=2, adapter_slots=1), discipline) == [0.0, 1.0]


def test_a_step_that_loads_an_adapter_lasts_longer():
    # x loads in the first step (1 s + 0.25 s), so the second request starts at 1.25 s
    assert queue_delays([job(0, 1), job(0, 1)], 1, model(load_s=0.25), "late_binding") == [0.0, 1.25]


def test_prefill_and_batch_size_set_the_step_time():
    costs = step_costs(0.5, per_seq_s=0.25, per_prefill_token_s=0.125)
    # step 1: both admitted, 2 seqs, 8 prompt tokens: 0.5 + 0.5 + 1.0 = 2.0 s; the third (slot-bound) starts then
    jobs = [job(0, 1), job(0, 1), job(0, 1)]
    assert queue_delays(jobs, 1, model(max_running=2, costs=costs), "late_binding") == [0.0, 0.0, 2.0]


def test_unknown_discipline_is_refused():
    with pytest.raises(ValueError, match="discipline 'fifo'"):
        queue_delays([job(0, 1)], 1, model(), "fifo")


def test_static_placement_sends_every_request_to_its_adapters_home():
    # x lives on replica 0 only: its requests queue there although replica 1 is idle; dispatch
    # at arrival sends the second to replica 1 (loading x) and the third behind one of them
    jobs = [job(0, 2, "x"), job(0, 2, "x"), job(0, 2, "x")]
    homes = {"x": 0}
    assert queue_delays(jobs, 2, model(), "static", homes=homes) == [0.0, 2.0, 4.0]
    assert queue_delays(jobs, 2, model(), "at_arrival") == [0.0, 0.0, 2.0]
    assert bound(jobs, 2, model(), homes=homes)["dispatch_vs_static"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="needs each adapter's home"):
        queue_delays(jobs, 2, model(), "static")


def test_a_full_kv_preempts_the_latest_arrival_which_recomputes_later():
    # blocks of 4 tokens, 2 per replica: A and B (3-token prompts) start with one block each; after
    # one token each needs 2, so B is preempted at t=1; A finishes at t=3, then B restarts
    # (re-prefilling its prompt and its token) and ends at t=5. Queueing counts its first start only.
    jobs = [TraceRequest(0, "x", 3, 3, 8), TraceRequest(0, "x", 3, 3, 8)]
    kv = model(max_running=2, kv_blocks=2, block_tokens=4)
    got = simulate(jobs, 1, kv, "at_arrival")
    assert (got.queue_s, got.latency_s, got.preemptions) == ([0.0, 0.0], [3.0, 5.0], 1)
    # late binding: the preempted B restarts at once on the idle second replica
    got = simulate(jobs, 2, kv, "late_binding")
    assert (got.queue_s, got.latency_s, got.preemptions) == ([0.0, 0.0], [3.0, 3.0], 1)
    # a request whose KV does not fit waits although a running slot is free
    assert queue_delays([TraceRequest(0, "x", 7, 2, 8), TraceRequest(0, "x", 7, 1, 8)], 1, kv, "at_arrival") == [
        0.0,
        2.0,
    ]


def test_the_balancers_own_planner_moves_a_request_queued_a_tick_to_a_free_replica():
    # the same trace: C queues behind A from t=0.5; at the t=1.0 tick it has waited one tick and
    # B's replica is free, so plan_queued sends it there
    jobs = [job(0, 10), job(0, 1), job(0.5, 1)]
    assert queue_delays(jobs, 2, model(), "balancer") == [0.0, 0.0, 0.5]
    # arriving at t=0.7, C has waited only 0.3 s at the t=1.0 tick: it moves at t=1.5
    assert queue_delays([job(0, 10), job(0, 1), job(0.7, 1)], 2, model(), "balancer") == [0.0, 0.0, pytest.approx(0.8)]


def test_the_event_balancer_moves_a_queued_request_when_a_slot_frees_not_at_the_next_tick():
    # C arrives at t=0.7 and queues behind A; B's replica frees its slot at t=1.0, when C has
    # waited 0.3 s (>= 0.1): the event balancer moves it then, where the tick balancer waited for
    # the t=1.5 tick (0.8 s, above); dispatch-time moves at step starts (`moves`) do the same
    jobs = [job(0, 10), job(0, 1), job(0.7, 1)]
    assert queue_delays(jobs, 2, model(), "balancer_events") == [0.0, 0.0, pytest.approx(0.3)]
    assert queue_delays(jobs, 2, model(), "moves") == [0.0, 0.0, pytest.approx(0.3)]
    got = bound(jobs, 2, model())
    assert got["gain_of_balancer_events"] == pytest.approx(got["gain_of_moves"])


def six_on_one_replica():
    """Six 10-token requests running on replica 0, none on replica 1, after the tick at 1 s: the
    count trigger fires (6 - 0 > 4) and the co-migration ILP plans to move some of them."""
    from dlora.sim.migration_bound import _Model

    jobs = [job(0, 10) for _ in range(6)]
    m = _Model(jobs, 2, model(max_running=8), "balancer", False, 0.1, None)
    busy, idle = m.replicas
    busy.running, busy.busy = list(range(6)), True
    busy.resident["x"] = idle.resident["x"] = 0.0
    m.admitted.update({i: 0.0 for i in range(6)})
    m.tick(1.0)
    return m, busy, idle


def test_a_balancer_round_moves_running_requests_off_an_overloaded_replica(monkeypatch):
    # The moved requests queue on replica 1 to recompute (the simulation check off: see the next test).
    from dlora.sim import migration_bound

    monkeypatch.setattr(migration_bound, "CHECK_DRAWS", 0)
    m, busy, idle = six_on_one_replica()
    moved = idle.queue
    assert 2 <= len(moved) <= 3 and sorted(busy.running + moved) == list(range(6))
    assert all(m.sent_at[i] == 1.0 for i in moved) and m.last_round == 1.0
    assert m.moved == m.moved_running == len(moved)
    m.tick(1.5)  # within the round interval (2 s): no second round
    assert m.last_round == 1.0


def test_a_round_whose_moves_the_simulation_finds_no_better_does_not_run():
    # The server's check on: this model's steps take one second whatever their batch, so three
    # sequences fewer leave replica 0's steps as long, and the moved three end no sooner on replica 1
    # (10 steps there too): no gain, so the round is decided but moves nothing.
    m, busy, idle = six_on_one_replica()
    assert m.last_round == 1.0 and idle.queue == [] and sorted(busy.running) == list(range(6)) and m.moved == 0


def test_the_shipped_dispatch_sends_a_request_to_the_replica_whose_step_ends_first():
    # Steps cost 1 s plus 1 ms per prompt token. A (4,000-token prompt, cap 10) and B (cap 100)
    # start on replicas 0 and 1 at t=0: A's prefill step lasts until t=5, B's first step until
    # t=1.004. C arrives at t=0.5: replica 0 has less pending work (A is expected to run to its cap
    # of 10, B to 100), so dLoRA's dispatch sends C there, to wait out A's prefill (4.5 s); the
    # shipped dispatch sees that replica 1 starts its next step 4 s sooner and sends C there.
    costs = step_costs(per_prefill_token_s=0.001)
    jobs = [TraceRequest(0, "x", 4000, 1, 10), TraceRequest(0, "x", 4, 100, 100), TraceRequest(0.5, "x", 4, 1, 10)]
    two_slots = model(max_running=2, costs=costs)
    assert queue_delays(jobs, 2, two_slots, "at_arrival") == [0.0, 0.0, pytest.approx(4.5)]
    assert queue_delays(jobs, 2, two_slots, "soonest_start") == [0.0, 0.0, pytest.approx(0.504)]
    got = bound(jobs, 2, two_slots)
    assert got["gain_of_soonest_start"] == pytest.approx(4.5 / 0.504)

"""MuxServe's KV quotas as the engine scheduler applies them (dlora/engine_ext/kv_quotas.py), on
plain stand-ins for vLLM's requests: which waiting requests wait, who is a borrower, the fairness
gap. 100 blocks of 16 tokens; a (hot) sends 3 requests per period, b (cold) 1."""

from __future__ import annotations

from types import SimpleNamespace

from dlora.engine_ext.kv_quotas import EngineKvQuotas


def req(rid: str, adapter: str | None, prompt: int = 160, computed: int = 0):
    lr = SimpleNamespace(lora_name=adapter) if adapter else None
    return SimpleNamespace(request_id=rid, lora_request=lr, num_prompt_tokens=prompt, num_computed_tokens=computed)


def quotas_after_one_period() -> EngineKvQuotas:
    q = EngineKvQuotas(total_blocks=100, block_size=16, period_s=10.0, now=0.0)
    for r in (req("a1", "a"), req("a2", "a"), req("a3", "a"), req("b1", "b")):
        q.arrived(r)
    q.refused([], [], now=10.0)  # the period ends: quotas 75 / 25 (rates 0.3 / 0.1 per second)
    assert q.quotas.quotas == {"a": 75, "b": 25}
    return q


def test_no_quota_before_the_first_period_ends():
    q = EngineKvQuotas(total_blocks=100, block_size=16, period_s=10.0, now=0.0)
    q.arrived(req("a1", "a"))
    running = [req("r", "a", computed=1600)]  # every block
    assert q.refused(running, [req("b1", "b")], now=5.0) == set()


def test_a_borrower_waits_while_an_owner_within_its_quota_starts():
    q = quotas_after_one_period()
    # a holds 80 blocks (5 over its 75), b 10 of its 25: 10 blocks free.
    running = [req("ra", "a", computed=80 * 16), req("rb", "b", computed=10 * 16)]
    waiting = [req("a-new", "a", prompt=8 * 16), req("b-new", "b", prompt=8 * 16)]
    assert q.refused(running, waiting, now=11.0) == {"a-new"}  # a would borrow; b is within quota
    assert q.borrowers() == {"a"}


def test_free_blocks_are_lent_to_a_borrower():
    q = quotas_after_one_period()
    running = [req("ra", "a", computed=70 * 16)]  # a within quota, 30 free
    assert q.refused(running, [req("a-new", "a", prompt=10 * 16)], now=11.0) == set()  # 5 borrowed


def test_the_fairness_gap_is_blocks_per_rate():
    q = quotas_after_one_period()
    q.refused([req("ra", "a", computed=30 * 16), req("rb", "b", computed=30 * 16)], [], now=11.0)
    # R_a = 30 / 0.3 = 100, R_b = 30 / 0.1 = 300
    assert abs(q.fairness_gap() - 200.0) < 1e-9


def test_observing_without_quotas_measures_the_gap_and_refuses_nothing():
    """With `scheduling.kv_quotas` off the scheduler only observes: the gap is still MuxServe's."""
    q = EngineKvQuotas(total_blocks=100, block_size=16, period_s=10.0, now=0.0)
    for _ in range(3):
        q.arrived(req("x", "a"))
    q.arrived(req("y", "b"))
    q.observe([req("ra", "a", computed=90 * 16), req("rb", "b", computed=2 * 16)], [req("w", "b")], now=10.0)
    assert q.used == {"a": 90, "b": 2}
    assert abs(q.fairness_gap() - (90 / 0.3 - 2 / 0.1)) < 1e-9  # a holds 300 blocks per req/s, b 20

"""Attainment needs both TTFT and TPOT; SeaLLM's normalized latency divides by the adapter's
average isolated execution time (Eq. 1)."""

from __future__ import annotations

import pytest

from dlora.slo.attainment import AttainmentCounter, attained, normalized_latency, tpot_s
from dlora.slo.config import AdapterSlo

SLO = AdapterSlo(ttft_s=1.0, tpot_s=0.5)


def test_tpot_is_decode_time_over_the_tokens_after_the_first():
    assert tpot_s(ttft_s=0.5, latency_s=2.5, output_tokens=5) == pytest.approx((2.5 - 0.5) / 4)  # 0.5
    assert tpot_s(ttft_s=0.5, latency_s=0.5, output_tokens=1) is None  # no decode phase
    assert tpot_s(ttft_s=0.5, latency_s=0.5, output_tokens=0) is None


def test_attained_only_when_both_targets_hold_and_a_target_met_exactly_counts():
    assert attained(1.0, 0.5, SLO)  # both exactly at the target
    assert not attained(1.01, 0.1, SLO)  # TTFT missed, TPOT fine
    assert not attained(0.1, 0.51, SLO)  # TPOT missed, TTFT fine
    assert attained(0.9, None, SLO)  # a one-token reply is judged on TTFT alone
    assert not attained(1.2, None, SLO)


def test_counter_keeps_per_adapter_attainment():
    c = AttainmentCounter()
    # "a": TTFT 0.5, 5 tokens in 2.5 s -> TPOT 0.5: attained
    assert c.record("a", ttft_s=0.5, latency_s=2.5, output_tokens=5, isolated_s=1.0, slo=SLO)
    # "a": TTFT 0.5, 5 tokens in 4.5 s -> TPOT 1.0: missed on TPOT
    assert not c.record("a", ttft_s=0.5, latency_s=4.5, output_tokens=5, isolated_s=1.0, slo=SLO)
    # "b": TTFT 2.0: missed on TTFT
    assert not c.record("b", ttft_s=2.0, latency_s=2.0, output_tokens=1, isolated_s=1.0, slo=SLO)
    a = c.counts("a")
    assert (a.requests, a.attained, a.ttft_met, a.tpot_met) == (2, 1, 2, 1)
    b = c.counts("b")
    assert (b.requests, b.attained, b.ttft_met, b.tpot_met) == (1, 0, 0, 1)
    assert a.attainment == pytest.approx(1 / 2)
    assert c.attainment() == pytest.approx(1 / 3)  # 1 of 3 requests
    assert c.attainment(["b"]) == 0.0
    assert c.counts("nobody").attainment is None and c.attainment(["nobody"]) is None


def test_normalized_latency_divides_by_the_adapters_average_isolated_time():
    c = AttainmentCounter()
    # "a": latencies 2 s and 4 s; isolated 1 s and 3 s -> L̂_a = (1 + 3) / 2 = 2 s
    c.record("a", ttft_s=0.1, latency_s=2.0, output_tokens=10, isolated_s=1.0, slo=SLO)
    c.record("a", ttft_s=0.1, latency_s=4.0, output_tokens=30, isolated_s=3.0, slo=SLO)
    # "b": latency 10 s, isolated 5 s -> L̂_b = 5 s
    c.record("b", ttft_s=0.1, latency_s=10.0, output_tokens=50, isolated_s=5.0, slo=SLO)
    assert c.counts("a").mean_isolated_s == pytest.approx(2.0)
    assert c.counts("a").normalized_latency == pytest.approx(2 / 2 + 4 / 2)  # 3.0, not 2/1 + 4/3
    assert c.counts("b").normalized_latency == pytest.approx(10 / 5)  # 2.0
    assert c.normalized_latency_sum() == pytest.approx(3.0 + 2.0)  # Eq. 1 over both adapters
    assert c.mean_normalized_latency() == pytest.approx(5.0 / 3)  # per request, as SeaLLM plots it
    assert AttainmentCounter().mean_normalized_latency() is None


def test_normalized_latency_term_and_counts_copy():
    assert normalized_latency(3.0, 1.5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        normalized_latency(3.0, 0.0)
    c = AttainmentCounter()
    c.record("a", ttft_s=0.1, latency_s=1.0, output_tokens=2, isolated_s=1.0, slo=SLO)
    snapshot = c.counts("a")
    snapshot.requests = 99
    assert c.counts("a").requests == 1  # the counter's own state is not handed out

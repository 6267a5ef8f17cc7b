"""SloAccounting: the SLO each request is held to (own, absolute default, k x isolated), its counts,
an unregistered adapter dropped; the isolated basis averaged over replicas; the /v1/adapters form
read back into the same accounting."""

from __future__ import annotations

import pytest

from dlora.cluster.estimators.replica_cost import CostParams
from dlora.slo.accounting import SloAccounting
from dlora.slo.config import AdapterSlo, SloConfig
from dlora.slo.isolated import isolated_times, mean_params
from dlora.slo.listing import accounting_from_listing, listing_json, slo_json

# Isolated TTFT = 0.004 + 0.0002 x prompt; isolated TPOT = 0.004 + 0.001 = 0.005.
P = CostParams(per_iteration_s=0.004, per_decode_token_s=0.001, per_prefill_token_s=0.0002)


def test_relative_default_judges_each_request_by_its_own_isolated_times():
    acc = SloAccounting(SloConfig(relative_k=5.0), P)
    # prompt 480: isolated TTFT 0.1 s -> target 0.5 s; TPOT target 5 x 0.005 = 0.025 s
    assert acc.record("a", prompt_tokens=480, ttft_s=0.5, latency_s=0.5 + 10 * 0.025, output_tokens=11)
    assert not acc.record("a", prompt_tokens=480, ttft_s=0.51, latency_s=0.6, output_tokens=2)  # TTFT missed
    # prompt 30: isolated TTFT 0.01 s -> target 0.05 s, so 0.5 s is a miss here
    assert not acc.record("a", prompt_tokens=30, ttft_s=0.5, latency_s=0.6, output_tokens=2)
    c = acc.counts()["a"]
    assert (c.requests, c.attained) == (3, 1)


def test_an_adapters_own_slo_wins_and_the_base_model_gets_the_default():
    acc = SloAccounting(SloConfig(ttft_s=0.2, tpot_s=0.02), P)
    acc.set_target("strict", AdapterSlo(ttft_s=0.1, tpot_s=0.01))
    acc.set_target("loose", AdapterSlo(ttft_s=1.0, tpot_s=0.1))
    times = dict(prompt_tokens=10, ttft_s=0.15, latency_s=0.15 + 4 * 0.015, output_tokens=5)
    assert not acc.record("strict", **times)  # TTFT 0.15 > 0.1
    assert acc.record("loose", **times)
    assert acc.record(None, **times)  # the base model: the absolute default 0.2 / 0.02
    assert acc.record("other", **times)  # no SLO of its own: the default
    assert acc.target("strict") == AdapterSlo(0.1, 0.01) and acc.target(None) is None
    acc.set_target("loose", None)  # back to the default
    assert acc.target("loose") is None


def test_normalized_latency_is_latency_over_the_adapters_mean_isolated_time():
    acc = SloAccounting(SloConfig(), P)
    # prompt 480, 101 tokens: isolated 0.1 + 100 x 0.005 = 0.6 s; latencies 1.2 and 2.4 s
    acc.record("a", prompt_tokens=480, ttft_s=0.2, latency_s=1.2, output_tokens=101)
    acc.record("a", prompt_tokens=480, ttft_s=0.2, latency_s=2.4, output_tokens=101)
    c = acc.counts()["a"]
    assert c.mean_isolated_s == pytest.approx(0.6)
    assert c.mean_normalized_latency == pytest.approx((1.2 + 2.4) / 0.6 / 2)  # 3.0
    assert acc.mean_normalized_latency() == pytest.approx(3.0)
    # TTFT 0.2 <= 0.5; TPOT 1.0 / 100 = 0.010 and 2.2 / 100 = 0.022, both <= 0.025
    assert acc.attainment() == 1.0


def test_forget_drops_the_adapters_target_and_counts():
    acc = SloAccounting(SloConfig(), P)
    acc.set_target("a", AdapterSlo(1.0, 0.1))
    acc.record("a", prompt_tokens=10, ttft_s=0.1, latency_s=0.2, output_tokens=3)
    acc.record("b", prompt_tokens=10, ttft_s=0.1, latency_s=0.2, output_tokens=3)
    acc.forget("a")
    assert set(acc.counts()) == {"b"} and acc.target("a") is None
    acc.forget("never-counted")  # harmless


def test_memory_does_not_grow_with_requests():
    acc = SloAccounting(SloConfig(), P)
    for i in range(1000):
        acc.record("a" if i % 2 else None, prompt_tokens=i, ttft_s=0.01, latency_s=0.02, output_tokens=2)
    counts = acc.counts()
    assert set(counts) == {"a", None} and counts["a"].requests == 500 and counts[None].requests == 500


def test_mean_params_averages_the_coefficients_isolated_times_are_made_of():
    a = CostParams(per_iteration_s=0.002, per_decode_token_s=0.001, per_prefill_token_s=0.0001, max_batch=8)
    b = CostParams(per_iteration_s=0.006, per_decode_token_s=0.003, per_prefill_token_s=0.0003, max_batch=8)
    m = mean_params([a, b])
    assert (m.per_iteration_s, m.per_decode_token_s, m.per_prefill_token_s) == pytest.approx((0.004, 0.002, 0.0002))
    # isolated times are linear in them: the mean basis gives the replicas' mean isolated times
    iso_a, iso_b, iso_m = (isolated_times(p, 100) for p in (a, b, m))
    assert iso_m.ttft_s == pytest.approx((iso_a.ttft_s + iso_b.ttft_s) / 2)
    assert iso_m.tpot_s == pytest.approx((iso_a.tpot_s + iso_b.tpot_s) / 2)
    assert mean_params([]) == CostParams()


@pytest.mark.parametrize(
    ("own", "cfg", "shown"),
    [
        (AdapterSlo(0.5, 0.05), SloConfig(), {"ttft_s": 0.5, "tpot_s": 0.05, "relative_k": None, "source": "adapter"}),
        (
            None,
            SloConfig(ttft_s=1.0, tpot_s=0.1),
            {"ttft_s": 1.0, "tpot_s": 0.1, "relative_k": None, "source": "default"},
        ),
        (None, SloConfig(relative_k=3.0), {"ttft_s": None, "tpot_s": None, "relative_k": 3.0, "source": "relative"}),
    ],
)
def test_slo_json_says_where_the_targets_come_from(own, cfg, shown):
    assert slo_json(own, cfg) == shown


def test_a_client_reading_the_listing_judges_requests_as_the_server_does():
    server = SloAccounting(SloConfig(relative_k=4.0), P)
    server.set_target("own", AdapterSlo(0.3, 0.02))
    listing = {
        "object": "list",
        "data": [
            {"name": "own", "slo": slo_json(server.target("own"), server.cfg)},
            {"name": "rel", "slo": slo_json(server.target("rel"), server.cfg)},
        ],
        **listing_json(server),
    }
    client = accounting_from_listing(listing)
    assert client.cfg == server.cfg and client.basis == server.basis
    assert client.target("own") == AdapterSlo(0.3, 0.02) and client.target("rel") is None
    cases = [
        ("own", 10, 0.25, 0.25 + 9 * 0.019, 10),  # met
        ("own", 10, 0.31, 0.40, 2),  # TTFT missed
        ("rel", 480, 0.39, 0.39 + 4 * 0.019, 5),  # 4 x (0.1, 0.005) = (0.4, 0.02): met
        ("rel", 480, 0.39, 0.39 + 4 * 0.021, 5),  # TPOT missed
        (None, 30, 0.05, 0.06, 2),  # base model: 4 x (0.01, 0.005) = (0.04, 0.02): TTFT missed
    ]
    for adapter, prompt, ttft, latency, out in cases:
        kw = dict(prompt_tokens=prompt, ttft_s=ttft, latency_s=latency, output_tokens=out)
        assert client.record(adapter, **kw) == server.record(adapter, **kw)
    assert client.counts() == server.counts()
    assert [c.attained for c in client.counts().values()] == [1, 1, 0]


@pytest.mark.parametrize(
    "listing",
    [
        {"object": "list", "data": []},  # another server's list, or dlora's before SLOs
        {"object": "list", "data": [{"name": "a"}], **listing_json(SloAccounting())},  # an entry without slo
        {"object": "list", "data": [], "slo_default": {"ttft_s": -1, "tpot_s": 1, "relative_k": None}, "isolated": {}},
        {"object": "list", "data": [], **listing_json(SloAccounting()), "isolated": {"per_iteration_s": "x"}},
    ],
)
def test_a_listing_without_usable_slos_is_a_value_error(listing):
    with pytest.raises(ValueError, match="the adapter list carries no SLOs"):
        accounting_from_listing(listing)

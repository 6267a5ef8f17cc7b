"""SloConfig and AdapterSlo: defaults, the absolute and SeaLLM-relative default SLO, and bad
values rejected with the key and the value named."""

from __future__ import annotations

import math
import re

import pytest

from dlora.cluster.estimators.replica_cost import CostParams
from dlora.slo.config import MIN_RELATIVE_SLO_S, AdapterSlo, SloConfig, from_dict, parse_adapter_slo
from dlora.slo.isolated import isolated_times

# per_iteration 4 ms, 1 ms per extra decode sequence, 0.2 ms per prompt token
P = CostParams(per_iteration_s=0.004, per_decode_token_s=0.001, per_prefill_token_s=0.0002)


def test_defaults_are_the_papers():
    cfg = SloConfig()
    assert cfg.relative and cfg.relative_k == 5.0  # SeaLLM §6.1: 5x the execution time
    assert (cfg.order, cfg.dispatch, cfg.kv_quotas) == ("fcfs", "least_pending", False)  # dLoRA's behaviour
    assert (cfg.gamma, cfg.reopt_beta) == (0.5, 0.1)  # Aladdin gamma, SeaLLM Eq. 8 beta


def test_isolated_times_from_the_cost_model():
    iso = isolated_times(P, prompt_tokens=480)
    assert iso.ttft_s == pytest.approx(0.004 + 0.0002 * 480)  # 0.100 s: one prefill step
    assert iso.tpot_s == pytest.approx(0.004 + 0.001)  # 0.005 s: a decode step of batch 1
    assert iso.execution_s(101) == pytest.approx(0.100 + 100 * 0.005)  # 0.6 s
    assert iso.execution_s(1) == pytest.approx(0.100)  # the first token comes with the prefill


def test_relative_default_is_k_times_the_isolated_ttft_and_tpot():
    iso = isolated_times(P, prompt_tokens=480)
    slo = SloConfig().slo_for(None, iso)
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx((5 * 0.100, 5 * 0.005))  # (0.5, 0.025)
    # Meeting both keeps SeaLLM's end-to-end SLO: 0.5 + 100 * 0.025 = 3.0 = 5 x 0.6
    assert slo.ttft_s + 100 * slo.tpot_s == pytest.approx(5 * iso.execution_s(101))
    assert SloConfig(relative_k=2.0).slo_for(None, iso).tpot_s == pytest.approx(0.010)


def test_absolute_default_and_an_adapters_own_slo_win_over_the_relative_one():
    iso = isolated_times(P, prompt_tokens=480)
    assert SloConfig(ttft_s=0.4, tpot_s=0.015).slo_for(None, iso) == AdapterSlo(0.4, 0.015)
    own = AdapterSlo(1.6, 0.075)
    assert SloConfig().slo_for(own, iso) == own
    assert SloConfig(ttft_s=0.4, tpot_s=0.015).slo_for(own, iso) == own


def test_relative_default_never_reaches_zero_on_a_zero_cost_model():
    iso = isolated_times(CostParams(per_iteration_s=0, per_decode_token_s=0, per_prefill_token_s=0), 100)
    assert SloConfig().slo_for(None, iso) == AdapterSlo(MIN_RELATIVE_SLO_S, MIN_RELATIVE_SLO_S)


@pytest.mark.parametrize(
    ("key", "value", "extra"),
    [
        ("relative_k", 0.5, {}),  # tighter than the isolated time
        ("relative_k", math.nan, {}),
        ("relative_k", math.inf, {}),
        ("relative_k", True, {}),
        ("order", "lifo", {}),
        ("dispatch", "random", {}),
        ("gamma", 1.5, {}),
        ("gamma", -0.1, {}),
        ("theta", 0.0, {}),
        ("theta", math.nan, {}),
        ("kv_quotas", "yes", {}),
        ("quota_period_s", -1.0, {}),
        ("quota_period_s", math.inf, {}),
        ("reopt_beta", 1.0, {}),
        ("reopt_beta", 0.0, {}),
        ("reopt_min_s", 0.0, {}),
        ("reopt_initial_s", 1000.0, {}),  # above reopt_max_s = 600
        ("reopt_initial_s", 1.0, {}),  # below reopt_min_s = 5
        ("ttft_s", -0.1, {"tpot_s": 0.01}),
        ("tpot_s", math.nan, {"ttft_s": 0.4}),
        ("tpot_s", None, {"ttft_s": 0.4}),  # only one absolute target set
        ("ttft_s", None, {"tpot_s": 0.01}),
    ],
)
def test_bad_config_values_name_the_key_and_the_value(key, value, extra):
    with pytest.raises(ValueError, match=re.escape(f"slo.{key}={value!r}")):
        SloConfig(**{key: value, **extra})


def test_from_dict_builds_and_rejects_unknown_keys():
    cfg = from_dict({"ttft_s": 0.4, "tpot_s": 0.015, "order": "seallm", "dispatch": "best_fit"})
    assert (cfg.relative, cfg.order, cfg.dispatch) == (False, "seallm", "best_fit")
    with pytest.raises(ValueError, match=re.escape("slo.ordre: unknown key")):
        from_dict({"ordre": "seallm"})


def test_adapter_slo_parsed_from_a_load_body():
    assert parse_adapter_slo({"ttft_s": 0.5, "tpot_s": 0.05}) == AdapterSlo(0.5, 0.05)
    assert parse_adapter_slo({"ttft_s": 2, "tpot_s": 0.05}) == AdapterSlo(2, 0.05)  # whole seconds are fine
    assert parse_adapter_slo(None) is None  # no SLO given: the default applies


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"ttft_s": -0.5, "tpot_s": 0.05}, "slo.ttft_s=-0.5"),
        ({"ttft_s": 0, "tpot_s": 0.05}, "slo.ttft_s=0"),
        ({"ttft_s": 0.5, "tpot_s": math.nan}, "slo.tpot_s=nan"),
        ({"ttft_s": 0.5, "tpot_s": math.inf}, "slo.tpot_s=inf"),
        ({"ttft_s": "0.5", "tpot_s": 0.05}, "slo.ttft_s='0.5'"),
        ({"ttft_s": True, "tpot_s": 0.05}, "slo.ttft_s=True"),
        ({"ttft_s": None, "tpot_s": 0.05}, "slo.ttft_s=None"),
        ({"ttft_s": 0.5}, "slo.tpot_s: missing"),
        ({"ttft_s": 0.5, "tpot_s": 0.05, "ttft": 1}, "slo.ttft: unknown key"),
        ([0.5, 0.05], "slo=[0.5, 0.05]"),
    ],
)
def test_bad_adapter_slo_names_the_key(body, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_adapter_slo(body)

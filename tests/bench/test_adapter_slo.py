"""The per-adapter SLO report: attainment, the coldest adapter's attainment and SeaLLM's normalized
latency by hand against a dlora-style adapter list; read from GET /v1/adapters after a run (a
server without that route gets no report); printed."""

from __future__ import annotations

import pytest

from dlora.bench.adapter_slo import adapter_slo_report
from dlora.bench.runner import RunOptions, run_benchmark
from dlora.bench.summary import format_result
from dlora.bench.workload import Request
from tests.bench.test_report import _r

QUIET = RunOptions(disable_tqdm=True, print_result=False)


def listing(default: dict, own: dict[str, dict], names=("a", "b"), per_iteration_s: float = 0.01) -> dict:
    """A GET /v1/adapters answer: `default` SLO, adapters with their own in `own`. Isolated TTFT =
    isolated TPOT = `per_iteration_s` (no per-token costs)."""
    data = []
    for n in names:
        slo = own.get(n)
        data.append({"name": n, "slo": {**slo, "relative_k": None, "source": "adapter"} if slo else default})
    isolated = {"per_iteration_s": per_iteration_s, "per_decode_token_s": 0.0, "per_prefill_token_s": 0.0}
    return {"object": "list", "data": data, "slo_default": default, "isolated": isolated}


DEFAULT = {"ttft_s": 0.3, "tpot_s": 0.15, "relative_k": None, "source": "default"}
# adapter a (own SLO 0.2 s / 0.2 s):
#   A: ttft 0.1, tpot 0.1, 4 tokens, latency 0.4 -> met; isolated 4 x 0.01 = 0.04
#   C: ttft 0.5, 1 token, latency 0.5             -> TTFT missed; isolated 0.01
#   F: failed                                    -> a miss
# adapter b (the default, 0.3 s / 0.15 s):
#   B: ttft 0.2, tpot 0.3, 2 tokens, latency 0.5  -> TPOT missed; isolated 0.02
#   D: failed
# base model "base" (the default):
#   E: ttft 0.1, tpot 0.1, 2 tokens, latency 0.2  -> met; isolated 0.02
RESULTS = [
    _r("a", 0.1, [0.1, 0.1, 0.1], 4, start=0.0),
    _r("b", 0.2, [0.3], 2, start=0.2),
    _r("a", 0.5, [], 1, start=1.2),
    _r("b", 0, [], 0, ok=False, start=1.5),
    _r("base", 0.1, [0.1], 2, start=1.6),
    _r("a", 0, [], 0, ok=False, start=1.7),
]


def test_report_by_hand():
    rep = adapter_slo_report(RESULTS, listing(DEFAULT, {"a": {"ttft_s": 0.2, "tpot_s": 0.2}}), base_model="base")
    assert rep["slo_attainment"] == pytest.approx(2 / 6)  # A and E of six sent
    # b (2 sent) is the least-requested adapter: the base model (1 sent) is no adapter
    assert rep["coldest_adapter"] == "b" and rep["slo_attainment_coldest_adapter"] == 0.0
    # SeaLLM Eq. 1 per adapter: a (0.4 + 0.5) / mean(0.04, 0.01) = 36; b 0.5 / 0.02 = 25; base 0.2 / 0.02 = 10
    assert rep["normalized_latency"] == pytest.approx((36 + 25 + 10) / 4)
    a, b = rep["per_adapter"]["a"], rep["per_adapter"]["b"]
    assert (a["requests"], a["completed"], a["attained"]) == (3, 2, 1)
    assert a["slo_attainment"] == pytest.approx(1 / 3) and a["normalized_latency"] == pytest.approx(18.0)
    assert a["slo"]["source"] == "adapter" and b["slo"] == DEFAULT
    assert (b["requests"], b["attained"], b["normalized_latency"]) == (2, 0, pytest.approx(25.0))
    assert rep["per_adapter"]["base"]["slo_attainment"] == 1.0


def test_relative_default_scales_each_requests_isolated_times():
    relative = {"ttft_s": None, "tpot_s": None, "relative_k": 5.0, "source": "relative"}
    # k = 5 x 0.01 = 0.05 s for TTFT and TPOT: A (0.1, 0.1) misses; with 0.04 s per step it is met
    assert adapter_slo_report(RESULTS[:1], listing(relative, {}), "base")["slo_attainment"] == 0.0
    assert adapter_slo_report(RESULTS[:1], listing(relative, {}, per_iteration_s=0.04), "base")["slo_attainment"] == 1.0


def test_only_base_model_requests_have_no_coldest_adapter():
    rep = adapter_slo_report([RESULTS[4]], listing(DEFAULT, {}), base_model="base")
    assert rep["coldest_adapter"] is None and rep["slo_attainment_coldest_adapter"] is None
    assert rep["slo_attainment"] == 1.0


def test_a_list_without_slos_is_refused():
    with pytest.raises(ValueError, match="carries no SLOs"):
        adapter_slo_report(RESULTS, {"object": "list", "data": []}, "base")


def test_run_reads_the_servers_slos_after_the_requests(fake, capsys):
    loose = {"ttft_s": 60.0, "tpot_s": 10.0}
    tight = {"ttft_s": 1e-6, "tpot_s": 1e-6, "relative_k": None, "source": "default"}
    fake.state.adapter_list = listing(tight, {"a0": loose}, names=("a0", "a1", "a2"))
    reqs = [Request(f"r{i}", 0.0, a, "x y", 2, 3) for i, a in enumerate(["a0", "a0", "a1", "a2", None])]
    res = run_benchmark(fake.url, reqs, QUIET, ignore_eos=True)
    slo = res["adapter_slo"]
    assert slo["slo_attainment"] == pytest.approx(2 / 5)  # a0's two; the rest cannot meet 1 us
    assert set(slo["per_adapter"]) == {"a0", "a1", "a2", "tiny-base"}  # the base model under its name
    assert slo["per_adapter"]["a0"]["slo_attainment"] == 1.0
    assert slo["coldest_adapter"] == "a1" and slo["slo_attainment_coldest_adapter"] == 0.0
    assert slo["normalized_latency"] > 0
    assert res["slo_attainment"] == 1.0  # dLoRA's per-token attainment is another key, unchanged

    fake.state.adapter_list = None  # vLLM has no such list: no report, the run is unaffected
    capsys.readouterr()
    res = run_benchmark(fake.url, reqs, QUIET, ignore_eos=True)
    assert res["adapter_slo"] is None and res["completed"] == 5
    assert "SLO" not in capsys.readouterr().err  # a server without the list is not an error


def test_printed_block_and_columns():
    from dlora.bench.report import compute_metrics, per_adapter_metrics

    rep = adapter_slo_report(RESULTS, listing(DEFAULT, {"a": {"ttft_s": 0.2, "tpot_s": 0.2}}), base_model="base")
    result = {
        **compute_metrics(RESULTS, 2.0),
        "duration": 2.0,
        "per_adapter": per_adapter_metrics(RESULTS, 2.0),
        "adapter_slo": rep,
    }
    lines = format_result(result, ("ttft",), (99,)).splitlines()
    assert "{:-^50}".format("Per-adapter SLO (TTFT and TPOT)") in lines
    assert any(line.startswith("SLO attainment (%):") and line.split()[-1] == "33.33" for line in lines)
    assert any(line.startswith("Normalized latency (x isolated):") and line.split()[-1] == "17.75" for line in lines)
    assert any(line.startswith("SLO attainment, coldest b (%):") and line.split()[-1] == "0.00" for line in lines)
    header = next(line for line in lines if line.startswith("adapter "))
    assert header.split()[-4:] == ["TTFT+TPOT", "%", "norm", "lat"]
    row_a = next(line for line in lines if line.startswith("a "))
    assert row_a.split()[-2:] == ["33.3", "18.00"]
    assert all(
        "TTFT+TPOT" not in line
        for line in format_result({**result, "adapter_slo": None}, ("ttft",), (99,)).splitlines()
    )

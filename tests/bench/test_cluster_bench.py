"""The cluster benchmark's repetition and summary logic (bench/cluster_balancing/run.py) and the
settings, configs and workloads it shares with the benchmarks that run or model its workloads
(dlora/bench/cluster_bench.py), no servers."""

from __future__ import annotations

import pytest

from bench.cluster_balancing.run import median_per_rate, parse_args, rep_order, summarize_reps
from dlora.bench.cluster_bench import (
    EOS_ADAPTER_SCALES,
    eos_adapter_scales,
    make_workload,
    parse_settings,
    policy_colors,
    server_config,
)
from dlora.bench.cluster_bench import POLICIES as ALL_POLICIES

POLICIES = ["round_robin_static", "proactive", "proactive_migration"]


def test_each_rep_rotates_the_policy_order():
    orders = [rep_order(POLICIES, r) for r in range(3)]
    assert all(sorted(o) == sorted(POLICIES) for o in orders)
    assert {o[0] for o in orders} == set(POLICIES) and {o[-1] for o in orders} == set(POLICIES)


def rep(rr, pro, mig, migrated=0):
    got = {"round_robin_static": rr, "proactive": pro, "proactive_migration": mig}
    return {
        "5.0": {
            name: {
                "mean_queue_time_ms": q,
                "mean_ttft_ms": q + 100,
                "avg_latency_per_output_token_ms": 50,
                "requests_migrated": migrated if name == "proactive_migration" else 0,
                "queue_by_adapter": {"a0": {"requests": 3}},
            }
            for name, q in got.items()
        }
    }


def test_reps_are_summarised_from_point_medians_and_from_each_reps_own_ratios():
    # rep 2 is a slow server for everyone: its ratios agree with rep 1's, its latencies do not
    reps = [rep(2000, 1000, 500), rep(6000, 3000, 1500, migrated=4), rep(1800, 1200, 1200)]
    med = median_per_rate(reps)["5.0"]
    assert med["proactive"]["mean_queue_time_ms"] == 1200 and med["proactive_migration"]["mean_queue_time_ms"] == 1200
    assert med["proactive_migration"]["requests_migrated"] == 0
    assert "queue_by_adapter" not in med["proactive"]  # not a number: per rep only
    s = summarize_reps(reps)
    assert s["queueing_vs_round_robin"] == pytest.approx(2000 / 1200)  # medians 2000 / 1200
    own = s["median_of_rep_ratios"]
    assert own["queueing_vs_round_robin"] == pytest.approx(4.0)  # median of 4, 4, 1.5
    assert own["queueing_vs_proactive_only"] == pytest.approx(2.0)  # median of 2, 2, 1
    assert [r["queueing_vs_proactive_only"] for r in s["per_rep"]] == pytest.approx([2.0, 2.0, 1.0])


def test_a_single_rep_keeps_the_plain_summary():
    s = summarize_reps([rep(2000, 1000, 500)])
    assert s["queueing_vs_round_robin"] == pytest.approx(4.0) and "median_of_rep_ratios" not in s


@pytest.mark.parametrize("max_loras, kv_blocks", [(4, None), (8, 20), (12, None)])
def test_server_config_batches_max_loras_adapters_and_is_a_valid_config(tmp_path, max_loras, kv_blocks):
    from dlora import config

    # through the bench's own parser, so every flag the config reads has its default
    argv = ["--max-loras", str(max_loras), "--request-rates", "1"]
    argv += ["--kv-blocks", str(kv_blocks)] if kv_blocks else []
    args = parse_args(argv)
    adapters = [tmp_path / f"a{i}" for i in range(8)]
    data = server_config(
        args, tmp_path / "base", adapters, 8123, tmp_path / "state", ALL_POLICIES["proactive_migration"]
    )
    cfg = config.from_dict(data)  # what `dlora serve --config` would accept
    assert cfg.engine.max_loras == max_loras
    assert cfg.engine.max_cpu_loras == max(8, max_loras)  # every adapter stays in host memory
    assert cfg.engine.num_kv_blocks == kv_blocks
    assert cfg.cluster.migration and cfg.cluster.dispatch == "proactive" and len(cfg.adapters) == 8


def test_more_adapters_than_a_replica_holds(tmp_path):
    """--adapters 32 --max-cpu-loras 8: the server registers all 32, each engine holds 8, the
    workload spreads over all 32 and their scales cycle through EOS_ADAPTER_SCALES."""
    from dlora import config

    args = parse_args(
        ["--adapters", "32", "--max-cpu-loras", "8", "--max-loras", "8", "--request-rates", "1", "--alpha", "0.5"]
    )
    adapters = [tmp_path / f"a{i}" for i in range(32)]
    cfg = config.from_dict(
        server_config(args, tmp_path / "base", adapters, 8123, tmp_path / "state", ALL_POLICIES["proactive"])
    )
    assert len(cfg.adapters) == 32 and cfg.engine.max_cpu_loras == 8 and cfg.engine.max_loras == 8
    work = make_workload(args, 1.0, 0, 400, None)
    assert {r.adapter for r in work} == {f"a{i}" for i in range(32)}
    scales = eos_adapter_scales(32)
    assert scales[:8] == list(EOS_ADAPTER_SCALES) and scales[8:16] == list(EOS_ADAPTER_SCALES)


@pytest.mark.parametrize(
    "argv, bad",
    [(["--adapters", "0"], "--adapters"), (["--max-loras", "8", "--max-cpu-loras", "4"], "--max-cpu-loras")],
)
def test_bad_adapter_counts_are_refused_naming_the_flag(argv, bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv + ["--request-rates", "1"])
    assert bad in capsys.readouterr().err


def test_every_policy_has_its_own_plot_colour():
    colors = policy_colors()
    assert set(colors) == set(ALL_POLICIES) and len(set(colors.values())) == len(ALL_POLICIES)


@pytest.mark.parametrize("argv", [[], ["--workload", "sharegpt-eos", "--adapters", "32", "--max-cpu-loras", "8"]])
def test_shared_settings_are_the_cluster_benchmarks_own(argv):
    """What bench/slo and bench/migration_bound read as the cluster benchmark's settings is what
    its own run takes from the same flags, less where its result goes."""
    own = vars(parse_args(argv))
    assert vars(parse_settings(argv)) == {k: v for k, v in own.items() if k not in ("out", "quick")}

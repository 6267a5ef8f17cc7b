import dataclasses
from pathlib import Path

import pytest

from dlora import config
from dlora.cluster.from_config import router_config
from dlora.config import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_valid_and_frozen():
    cfg = config.load(None)
    assert cfg.model.path == config.DEFAULT_MODEL
    assert cfg.server.host == "127.0.0.1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1


def test_yaml_fills_sections_and_resolves_paths_against_the_file(tmp_path):
    (tmp_path / "sub").mkdir()
    p = write(
        tmp_path / "sub",
        """
model: {path: ../m, dtype: float32, max_model_len: 256}
engine: {max_loras: 2, max_lora_rank: 8, max_cpu_loras: 4}
server: {port: 9001, adapter_roots: [../adapters]}
adapters:
  - {name: a, path: ../adapters/a, pinned: true}
""",
    )
    cfg = config.load(p)
    assert cfg.model.path == str((tmp_path / "m").resolve())
    assert cfg.model.dtype == "float32" and cfg.engine.max_loras == 2 and cfg.server.port == 9001
    assert cfg.server.adapter_roots == (str((tmp_path / "adapters").resolve()),)
    assert cfg.adapters == (config.AdapterSpec("a", str((tmp_path / "adapters" / "a").resolve()), True),)


@pytest.mark.parametrize(
    "text, match",
    [
        ("model: {dtype: float8}", r"model.dtype='float8'"),
        ("engine: {max_lora_rank: 7}", r"engine.max_lora_rank=7"),
        ("engine: {max_loras: 8, max_cpu_loras: 4}", r"engine.max_cpu_loras=4"),
        ("engine: {kv_cache_space_gib: 0.5}", r"engine.kv_cache_space_gib=0.5"),
        ("engine: {lora_backend: cuda}", r"engine.lora_backend='cuda'"),
        ("engine: {num_kv_blocks: 1}", r"engine.num_kv_blocks=1: must be >= 2"),
        ("engine: {num_kv_blocks: 64.5}", r"engine.num_kv_blocks=64.5: must be a whole number \(or null\)"),
        ("server: {port: 70000}", r"server.port=70000"),
        ("server: {log_level: loud}", r"server.log_level='loud': must be one of critical, error, warning, info, debug"),
        ("server: {prot: 1}", r"unknown key\(s\) \['prot'\]"),
        ("servr: {}", r"unknown top-level key\(s\) \['servr'\]"),
        ("adapters: [{name: a}]", r"adapters\[0\]"),
        ("model: [1, 2]", r"model: expected a mapping"),
        ("cluster: {output_length_window: -1}", r"cluster.output_length_window=-1: must be a whole number >= 0"),
        ("cluster: {output_length_min_samples: 0}", r"cluster.output_length_min_samples=0"),
        ("cluster: {output_length_prior: 0.5}", r"cluster.output_length_prior=0.5: must be a whole number \(or null\)"),
        ("cluster: {migrate_queued: 'yes'}", r"cluster.migrate_queued='yes': must be true or false"),
        ("cluster: {queued_min_wait_s: -0.1}", r"cluster.queued_min_wait_s=-0.1: must be a number of seconds >= 0"),
        ("cluster: {migration_check_draws: -1}", r"cluster.migration_check_draws=-1: must be >= 0"),
        ("cluster: {migration_check_draws: 2.5}", r"cluster.migration_check_draws=2.5: must be a whole number"),
        ("cluster: {rebalance_min_gain_s: -1}", r"cluster.rebalance_min_gain_s=-1: must be a number of seconds >= 0"),
        (
            "cluster: {dispatch_start_slack_s: -0.01}",
            r"cluster.dispatch_start_slack_s=-0.01: must be a number of seconds >= 0",
        ),
        ("cluster: {replica_stall_timeout_s: 0}", r"cluster.replica_stall_timeout_s=0: must be > 0"),
        ("batch: {min_stage_gain: 1}", r"batch.min_stage_gain=1: must be >= 0 and < 1"),
        ("batch: {min_stage_gain: -0.1}", r"batch.min_stage_gain=-0.1: must be >= 0 and < 1"),
        # Every field's kind is checked against its annotation before the field's own range check,
        # so a string or a YAML bool is named instead of failing with Python's comparison TypeError.
        ("scheduling: {switch_cost_s: abc}", r"scheduling.switch_cost_s='abc': must be a number$"),
        ("scheduling: {break_period_iters: 2.5}", r"scheduling.break_period_iters=2.5: must be a whole number$"),
        ("cluster: {num_replicas: '2'}", r"cluster.num_replicas='2': must be a whole number$"),
        ("cluster: {migration: 1}", r"cluster.migration=1: must be true or false$"),
        ("server: {port: true}", r"server.port=True: must be a whole number$"),
        ("model: {dtype: 16}", r"model.dtype=16: must be a string$"),
        ("adapters: [{name: a, path: /a, pinned: 'yes'}]", r"adapters.pinned='yes': must be true or false$"),
        # slo: the default SLO, and an adapter's own
        ("slo: {ttft_s: 0.4}", r"^slo.tpot_s=None: set both slo.ttft_s and slo.tpot_s"),
        ("slo: {ttft_s: -1, tpot_s: 0.1}", r"^slo.ttft_s=-1: must be a finite number of seconds > 0$"),
        ("slo: {ttft_s: .nan, tpot_s: 0.1}", r"^slo.ttft_s=nan: must be a finite number of seconds > 0$"),
        ("slo: {ttft_s: 1, tpot_s: '0.1'}", r"^slo.tpot_s='0.1': must be a number \(or null\)$"),
        ("slo: {relative_k: 0.5}", r"^slo.relative_k=0.5: must be a finite number >= 1"),
        ("slo: {relative_k: true}", r"^slo.relative_k=True: must be a number$"),
        ("slo: {order: seallm}", r"^slo: unknown key\(s\) \['order'\]"),  # policies not served yet
        ("slo: [1]", r"^slo: expected a mapping"),
        ("adapters: [{name: a, path: /a, slo: {ttft_s: 0, tpot_s: 1}}]", r"^adapters.slo.ttft_s=0: must be a finite"),
        ("adapters: [{name: a, path: /a, slo: {ttft_s: 1}}]", r"^adapters.slo.tpot_s: missing .*\(adapter 'a'\)$"),
        ("adapters: [{name: a, path: /a, slo: {ttft: 1, tpot_s: 1}}]", r"^adapters.slo.ttft: unknown key"),
        ("adapters: [{name: a, path: /a, slo: 0.5}]", r"^adapters.slo=0.5: must be an object with ttft_s and tpot_s"),
        # cluster.autoscale: a mapping of AutoscaleConfig's keys
        ("cluster: {autoscale: {max_replica: 2}}", r"^cluster.autoscale: unknown key\(s\) \['max_replica'\]"),
        ("cluster: {autoscale: {max_replicas: '2'}}", r"^cluster.autoscale.max_replicas='2': must be a whole number$"),
        ("cluster: {autoscale: {max_replicas: 0}}", r"^cluster.autoscale.min_replicas=1, max_replicas=0: need 1 <="),
        ("cluster: {autoscale: {max_replicas: 2, heartbeat_s: 0}}", r"^cluster.autoscale.heartbeat_s=0: must be > 0$"),
        ("cluster: {autoscale: 2}", r"^cluster.autoscale=2: must be a mapping or null$"),
        ("cluster: {autoscale: {min_attainment: 95}}", r"^cluster.autoscale.min_attainment=95: must be in \[0, 1\]$"),
        ("cluster: {autoscale: {min_arrivals: -1}}", r"^cluster.autoscale.min_arrivals=-1: must be a whole num"),
        ("cluster: {autoscale: {frontier_points: 0}}", r"^cluster.autoscale.frontier_points=0: must be a whole number"),
        ("cluster: {num_replicas: 3, autoscale: {max_replicas: 2}}", r"^cluster.num_replicas=3: must be within"),
        ("cluster: {placement: static, autoscale: {max_replicas: 2}}", r"^cluster.placement='static': must be dynamic"),
    ],
)
def test_bad_values_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        config.load(write(tmp_path, text))


def test_constructors_check_kinds_too():
    """Configs built in code (the simulator, tests, bench scripts) get the kind errors YAML gets,
    and numpy's numbers pass for numbers."""
    import numpy as np

    from dlora.scheduling import BatchingConfig

    with pytest.raises(ConfigError, match=r"^cluster.count_imbalance='4': must be a whole number$"):
        config.ClusterConfig(count_imbalance="4")
    with pytest.raises(ConfigError, match=r"^cluster.count_imbalance=.*4\.0\)?: must be a whole number$"):
        config.ClusterConfig(count_imbalance=np.float64(4.0))
    with pytest.raises(ValueError, match=r"^scheduling.mixed_merged=1: must be true or false$"):
        BatchingConfig(mixed_merged=1)
    with pytest.raises(ConfigError, match=r"^engine.kv_cache_space_gib=None: must be a whole number$"):
        config.EngineConfig(kv_cache_space_gib=None)
    built = config.ClusterConfig(count_imbalance=np.int64(4), queue_delay_s=np.float32(0.5))
    assert (built.count_imbalance, built.queue_delay_s) == (4, 0.5)


def adapters_yaml(pinned: int, unpinned: int = 0) -> str:
    specs = [f"{{name: p{i}, path: /a/p{i}, pinned: true}}" for i in range(pinned)]
    specs += [f"{{name: u{i}, path: /a/u{i}}}" for i in range(unpinned)]
    return f"adapters: [{', '.join(specs)}]\n"


def test_pinned_adapters_must_leave_max_loras_free_in_the_cpu_cache(tmp_path):
    """Pinned adapters never leave vLLM's host LoRA cache; a batch of max_loras other adapters needs
    max_loras unpinned entries, or loading one evicts another of the same batch (the engine dies)."""
    engine = "engine: {max_loras: 2, max_cpu_loras: 4}\n"
    with pytest.raises(
        ConfigError,
        match=r"engine.max_cpu_loras=4: must be >= engine.max_loras \(2\) "
        r"\+ the 3 pinned adapter\(s\) \['p0', 'p1', 'p2'\]",
    ):
        config.load(write(tmp_path, engine + adapters_yaml(pinned=3)))
    # Exactly max_loras entries left: fine; unpinned adapters may outnumber the cache (loaded on demand).
    cfg = config.load(write(tmp_path, engine + adapters_yaml(pinned=2, unpinned=6)))
    assert [a.pinned for a in cfg.adapters].count(True) == 2
    # The CLI flags are checked the same way.
    with pytest.raises(ConfigError, match=r"engine.max_cpu_loras=3: must be >= engine.max_loras \(2\)"):
        config.override(cfg, {"engine.max_cpu_loras": 3})
    with pytest.raises(ConfigError, match=r"engine.max_cpu_loras=4: must be >= engine.max_loras \(3\)"):
        config.override(cfg, {"engine.max_loras": 3})


def test_test_server_config_is_valid():
    """The config the live-server tests start (tests/harness.py) passes validation."""
    from types import SimpleNamespace

    from tests import harness

    model = SimpleNamespace(base=Path("/m/base"), adapters={f"a{i}": Path(f"/m/a{i}") for i in range(4)})
    cfg = config.from_dict(harness.tiny_config(model, Path("/state"), 8000))
    assert [a.name for a in cfg.adapters if a.pinned] == ["a0"]


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(write(tmp_path, "model: {path: [unclosed"))


def test_overrides_apply_dotted_keys_and_revalidate():
    cfg = config.override(config.load(None), {"server.port": 9100, "engine.max_loras": None})
    assert cfg.server.port == 9100 and cfg.engine.max_loras == config.EngineConfig().max_loras
    with pytest.raises(ConfigError, match="server.port=-1"):
        config.override(cfg, {"server.port": -1})
    with pytest.raises(ConfigError, match="unknown config key 'server.nope'"):
        config.override(cfg, {"server.nope": 1})
    with pytest.raises(ConfigError, match=r"scheduling.t_starve='x': must be a number$"):
        config.override(cfg, {"scheduling.t_starve": "x"})


def test_admin_token_env_overrides_config(monkeypatch):
    cfg = config.from_dict({"server": {"admin_token": "from-file"}})
    assert cfg.admin_token == "from-file"
    monkeypatch.setenv("DLORA_ADMIN_TOKEN", "from-env")
    assert cfg.admin_token == "from-env"


def test_scheduling_section_holds_the_policy_and_its_parameters(tmp_path):
    from dlora.scheduling import BatchingConfig

    cfg = config.load(write(tmp_path, "scheduling: {policy: dlora, alpha: 0.8, beta: 0.5, t_starve: 3.0}"))
    s = cfg.scheduling
    assert (s.policy, s.alpha, s.beta, s.t_starve) == ("dlora", 0.8, 0.5, 3.0)
    assert s.batching() == BatchingConfig(alpha=0.8, beta=0.5, t_starve=3.0)
    assert s.to_engine() == {"policy": "dlora", **dataclasses.asdict(s.batching())}
    defaults = config.load(None).scheduling
    assert defaults.policy == "unmerged" and defaults.batching() == BatchingConfig()
    assert config.override(cfg, {"scheduling.merged_max_iters": 4}).scheduling.merged_max_iters == 4
    assert defaults.mixed_merged is False
    on = config.load(write(tmp_path, "scheduling: {policy: dlora, mixed_merged: true}")).scheduling
    assert on.to_engine()["mixed_merged"] is True
    assert defaults.lora_slot_starve_s is None  # vLLM's own max_loras admission
    on = config.load(write(tmp_path, "scheduling: {lora_slot_starve_s: 0.5}")).scheduling
    assert on.to_engine()["lora_slot_starve_s"] == 0.5


@pytest.mark.parametrize(
    "text, match",
    [
        ("scheduling: {policy: fifo}", r"scheduling.policy='fifo': must be one of unmerged, merged, dlora"),
        ("scheduling: {alpha: 0.5, beta: 0.6}", r"scheduling.alpha="),
        ("scheduling: {t_normal: 3.0}", r"scheduling.t_normal=3.0"),
        ("scheduling: {merged_max_iters: 0}", r"scheduling.merged_max_iters=0"),
        ("scheduling: {mixed_merged: 'no'}", r"scheduling.mixed_merged='no': must be true or false"),
        ("scheduling: {lora_slot_starve_s: -1}", r"scheduling.lora_slot_starve_s=-1: must be a number of seconds >= 0"),
        (
            "scheduling: {lora_slot_starve_s: soon}",
            r"scheduling.lora_slot_starve_s='soon': must be a number \(or null\)",
        ),
        ("scheduling: {lora_slot_starve_s: true}", r"scheduling.lora_slot_starve_s=True: must be a number \(or null\)"),
        ("scheduling: {alfa: 0.5}", r"unknown key\(s\) \['alfa'\]"),
    ],
)
def test_bad_scheduling_values_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        config.load(write(tmp_path, text))


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "configs"
    for path in sorted(root.glob("*.yaml")):
        config.load(path)
    assert config.load(root / "default.yaml").scheduling.policy == "dlora"


def test_output_length_options_reach_the_estimator_config(tmp_path):
    cfg = config.load(
        write(tmp_path, "cluster: {output_length_window: 32, output_length_min_samples: 4, output_length_prior: 100}")
    )
    est = router_config(cfg).output_lengths
    assert (est.window, est.min_samples, est.prior_tokens) == (32, 4, 100)
    assert router_config(config.DloraConfig()).output_lengths.prior_tokens is None  # default: max_tokens until data


def test_queued_migration_is_on_by_default_and_waits_one_monitor_interval_unless_told(tmp_path):
    cluster = config.DloraConfig().cluster
    assert cluster.migrate_queued and cluster.queued_wait_s == cluster.monitor_interval_s == 1.0
    cfg = config.load(write(tmp_path, "cluster: {monitor_interval_s: 0.5, migrate_queued: false}"))
    assert not cfg.cluster.migrate_queued and cfg.cluster.queued_wait_s == 0.5
    assert config.load(write(tmp_path, "cluster: {queued_min_wait_s: 0}")).cluster.queued_wait_s == 0.0
    assert cluster.rebalance_min_gain_s is None  # moves between busy replicas: opt-in
    assert config.load(write(tmp_path, "cluster: {rebalance_min_gain_s: 2.5}")).cluster.rebalance_min_gain_s == 2.5


def test_dlora_lora_backends_refuse_cuda_graphs():
    with pytest.raises(ConfigError, match="engine.lora_backend='triton'.*enforce_eager: true"):
        config.from_dict({"engine": {"lora_backend": "triton", "enforce_eager": False}})
    with pytest.raises(ConfigError, match="enforce_eager"):
        config.from_dict({"engine": {"lora_backend": "einsum", "enforce_eager": False}})
    assert not config.from_dict({"engine": {"lora_backend": "vllm", "enforce_eager": False}}).engine.enforce_eager
    assert config.from_dict({"engine": {"lora_backend": "triton"}}).engine.enforce_eager  # the default


def test_slo_section_defaults_to_the_relative_slo_and_maps_onto_the_policy_config(tmp_path):
    from dlora.slo.config import AdapterSlo, SloConfig

    default = config.DloraConfig()
    assert default.slo.policy() == SloConfig()  # relative, k = 5 (SeaLLM)
    assert router_config(default).slo.relative and router_config(default).slo.relative_k == 5.0
    cfg = config.load(
        write(
            tmp_path,
            """
slo: {ttft_s: 0.4, tpot_s: 0.02}
adapters:
  - {name: a, path: /a/a, slo: {ttft_s: 1, tpot_s: 0.05}}
  - {name: b, path: /a/b}
""",
        )
    )
    assert router_config(cfg).slo == SloConfig(ttft_s=0.4, tpot_s=0.02)  # what the router judges by
    assert cfg.adapters[0].slo == AdapterSlo(1, 0.05) and cfg.adapters[1].slo is None
    assert config.load(write(tmp_path, "slo: {relative_k: 2.5}")).slo.policy().relative_k == 2.5


def test_autoscale_is_off_by_default_and_parsed_from_its_mapping(tmp_path):
    from dlora.config import AutoscaleConfig

    assert config.load(None).cluster.autoscale is None
    cfg = config.load(write(tmp_path, "cluster: {num_replicas: 2, autoscale: {min_replicas: 1, max_replicas: 4}}"))
    assert cfg.cluster.autoscale == AutoscaleConfig(min_replicas=1, max_replicas=4)

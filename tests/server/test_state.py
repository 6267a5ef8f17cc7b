from dlora.config import from_dict
from dlora.server.state import router_config


def test_router_config_takes_the_engines_adapter_and_batch_limits():
    cfg = from_dict(
        {
            "engine": {"max_loras": 3, "max_cpu_loras": 9, "max_num_seqs": 24},
            "cluster": {"dispatch": "round_robin", "placement": "static"},
        }
    )
    rc = router_config(cfg)
    assert (rc.batch_adapter_slots, rc.adapter_slots, rc.max_batch) == (3, 9, 24)
    assert (rc.dispatch, rc.static_placement) == ("round_robin", True)
    assert not router_config(from_dict({})).static_placement


def test_router_config_takes_the_dispatch_start_slack_and_its_null():
    assert router_config(from_dict({})).dispatch_start_slack_s == 0.05
    assert router_config(from_dict({"cluster": {"dispatch_start_slack_s": None}})).dispatch_start_slack_s is None

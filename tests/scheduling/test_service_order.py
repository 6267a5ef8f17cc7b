"""The dlora policy's service order (`scheduling.order`): FCFS, or SeaLLM's doubling-budget priority.

Hand-worked: which requests the unmerged batch takes and in what order, how an adapter's merged
batch is ordered, and that credits still count from FCFS so a pushed-back adapter is served once it
starves (the bound of Alg. 3 holds for the order as for merges)."""

from __future__ import annotations

import dataclasses

import pytest

from dlora.scheduling import BatchingConfig, Mode
from dlora.scheduling.dlora_policy import DLoRAPolicy
from dlora.scheduling.dynamic_batching import build_queues
from dlora.scheduling.types import RequestView
from tests.scheduling.simlib import req


def cfg(**kw) -> BatchingConfig:
    base = dict(order="seallm", merge_planner=False, alpha=1.0, beta=0.6, max_batch=2)
    return BatchingConfig(**{**base, **kw})


def finished(policy: DLoRAPolicy, adapter: str, lengths: list[int], t: float) -> float:
    """Let `policy` see requests of `adapter` finish with these output lengths."""
    views = [req(f"{adapter}-done-{i}", adapter, t, output=n - 1, running=True) for i, n in enumerate(lengths)]
    policy.decide(views, t, 64)
    policy.decide([], t + 0.001, 64)
    return t + 0.002


def test_fcfs_is_the_default_and_leaves_the_batch_as_it_was():
    assert BatchingConfig().order == "fcfs"
    rs = [req("a0", "a", 0.0), req("b0", "b", 1.0), req("a1", "a", 2.0)]
    q = build_queues(rs, 2)
    assert q.batch == q.fcfs and [r.req_id for r in q.batch] == ["a0", "b0"]


def test_seallm_serves_the_adapter_with_short_outputs_first():
    # Adapter "long" writes 1,000 tokens (mu 1000, sigma 0: Q_0 = 1000, O_r = 1000 * 1000 = 1e6),
    # "short" writes 10 (O_r = 10 * 10 = 100). The long one's request came first; with a batch of
    # 2 and three requests, SeaLLM's order runs both short ones and holds the long one back.
    p = DLoRAPolicy(cfg())
    t = finished(p, "long", [1000] * 8, 0.0)
    t = finished(p, "short", [10] * 8, t)
    rs = [req("L", "long", t), req("S1", "short", t + 1), req("S2", "short", t + 2)]
    d = p.decide(rs, t + 3, 2)
    assert d.mode is Mode.UNMERGED and d.allowed_req_ids == ("S1", "S2")
    fcfs = DLoRAPolicy(cfg(order="fcfs"))
    assert fcfs.decide(rs, t + 3, 2).allowed_req_ids == ("L", "S1")


def test_a_request_past_its_budget_sinks_behind_a_fresh_one():
    # One adapter, outputs of 100 tokens (Q_0 = 100). A request that has generated 100 tokens
    # used its first budget: its second is 200 (remaining 200 * 100 = 2e4) against a fresh one's
    # 100 * 100 = 1e4: the fresh one, later in FCFS, goes first.
    p = DLoRAPolicy(cfg(max_batch=1))
    t = finished(p, "a", [100] * 8, 0.0)
    old = req("old", "a", t, output=100, running=True)
    new = req("new", "a", t + 1)
    assert p.decide([old, new], t + 2, 1).allowed_req_ids == ("new",)


def test_credits_still_count_from_fcfs_so_a_pushed_back_adapter_is_served_once_it_starves():
    # The long adapter's request is in B_fcfs but not run: it earns a second of credit per second.
    # From initial_credit 1.0 past t_starve 2.0 it starves and is served first.
    p = DLoRAPolicy(cfg(t_starve=2.0, t_normal=1.5, initial_credit=1.0, credit_relax_per_s=0.0))
    t = finished(p, "long", [1000] * 8, 0.0)
    t = finished(p, "short", [10] * 8, t)
    rs: list[RequestView] = [req("L", "long", t), req("S1", "short", t + 0.5), req("S2", "short", t + 0.6)]
    served_long_at = None
    now = t + 1
    for _ in range(200):
        d = p.decide(rs, now, 2)
        if "L" in d.allowed_req_ids:
            served_long_at = now
            break
        now += 0.1
    assert served_long_at is not None
    assert served_long_at - (t + 1) == pytest.approx(1.0, abs=0.25)  # held back ~ t_starve - initial


def test_the_merged_batch_takes_its_adapters_requests_in_service_order():
    p = DLoRAPolicy(cfg(alpha=0.5, beta=0.3, max_batch=2))
    t = finished(p, "a", [100] * 8, 0.0)
    rs = [req("a-old", "a", t, output=150, running=True), req("a-new", "a", t + 1), req("a-mid", "a", t + 2)]
    d = p.decide(rs, t + 3, 2)
    assert d.mode is Mode.MERGED and d.allowed_req_ids == ("a-new", "a-mid")


def test_an_unknown_order_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="scheduling.order='lifo'"):
        BatchingConfig(order="lifo")


@pytest.mark.parametrize("order", ["fcfs", "seallm"])
def test_batch_work_queued_first_is_served_after_every_online_request(order):
    # Batch requests carry a larger engine priority: though they arrived first, the batch of 2
    # takes the two online requests, and an adapter's merged batch orders them the same way.
    def batch(i: int, adapter: str):
        return dataclasses.replace(req(f"batch{i}", adapter, float(i)), priority=1_000_000)

    online = [req("online-a", "a", 10.0), req("online-b", "b", 11.0)]
    p = DLoRAPolicy(cfg(order=order, alpha=1.0))
    queued = [batch(i, adapter) for i, adapter in enumerate("cde")] + online
    assert p.decide(queued, 12.0, 2).allowed_req_ids == ("online-a", "online-b")
    q = build_queues([batch(i, "a") for i in range(3)] + online, 2)
    assert [r.req_id for r in q.group("a")] == ["online-a", "batch0", "batch1", "batch2"]

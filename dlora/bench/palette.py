"""Plot colours shared by the benchmark scripts, so one policy has one colour in every figure."""

from __future__ import annotations

from collections.abc import Iterable

# merged/unmerged batching policies of one replica, and vLLM's own server as the control
BATCHING_POLICY_COLORS = {"unmerged": "#4477aa", "merged": "#ccbb44", "dlora": "#cc3311", "vllm": "#777777"}

# cluster policies: the two baselines and dlora's default fixed across results, variants after them
CLUSTER_POLICY_FIXED = {"round_robin_static": "#999999", "proactive": "#4477aa", "proactive_migration": "#228833"}
CLUSTER_VARIANT_COLORS = ("#ccbb44", "#66ccee", "#aa3377", "#ee6677", "#bbbbbb", "#222255")


def cluster_policy_colors(policies: Iterable[str]) -> dict[str, str]:
    """One colour per cluster policy, in the order given."""
    variants = iter(CLUSTER_VARIANT_COLORS)
    return {name: CLUSTER_POLICY_FIXED.get(name) or next(variants) for name in policies}

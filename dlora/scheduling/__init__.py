"""Pure-Python batching policies (dLoRA §4.2 and Appendix A) over plain dataclasses.

policy = make_policy("dlora", BatchingConfig())
decision = policy.decide(request_views, now)       # each engine step
policy.observe(IterationStats(...))                 # after the step
"""

from dlora.scheduling.config import BatchingConfig
from dlora.scheduling.dlora_policy import DLoRAPolicy
from dlora.scheduling.policies import BatchingPolicy, MergedPolicy, UnmergedPolicy, check_decision
from dlora.scheduling.registry import POLICIES, make_policy, policy_names
from dlora.scheduling.types import (
    BASE,
    Decision,
    IterationStats,
    Mode,
    PolicySnapshot,
    RequestView,
    Switch,
)

__all__ = [
    "BASE",
    "BatchingConfig",
    "BatchingPolicy",
    "DLoRAPolicy",
    "Decision",
    "IterationStats",
    "MergedPolicy",
    "Mode",
    "POLICIES",
    "PolicySnapshot",
    "RequestView",
    "Switch",
    "UnmergedPolicy",
    "check_decision",
    "make_policy",
    "policy_names",
]

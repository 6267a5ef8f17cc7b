"""Policy names -> classes: `make_policy("dlora", config)`."""

from __future__ import annotations

from dlora.scheduling.config import BatchingConfig
from dlora.scheduling.dlora_policy import DLoRAPolicy
from dlora.scheduling.policies import BatchingPolicy, MergedPolicy, UnmergedPolicy

POLICIES: dict[str, type[BatchingPolicy]] = {cls.name: cls for cls in (UnmergedPolicy, MergedPolicy, DLoRAPolicy)}


def policy_names() -> tuple[str, ...]:
    return tuple(POLICIES)


def make_policy(name: str, config: BatchingConfig | None = None) -> BatchingPolicy:
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown batching policy {name!r}: supported are {', '.join(POLICIES)}") from None
    return cls(config)

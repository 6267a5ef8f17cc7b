"""`scheduling:` = the batching policy of every replica (its parameters are defined once, in
dlora.scheduling's BatchingConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from dlora.config.checks import as_config_error, check
from dlora.scheduling import BatchingConfig, policy_names


@dataclass(frozen=True)
class SchedulingConfig(BatchingConfig):
    """`scheduling:` = the batching policy's name plus its parameters (`dlora.scheduling.BatchingConfig`,
    the one definition of them, with its defaults and checks)."""

    # unmerged (vLLM's behaviour) | merged (one adapter at a time) | dlora (Algorithms 1-3)
    policy: str = "unmerged"

    def __post_init__(self) -> None:
        as_config_error(super().__post_init__)
        check(
            self.policy in policy_names(),
            "scheduling.policy",
            self.policy,
            f"must be one of {', '.join(policy_names())}",
        )

    def batching(self) -> BatchingConfig:
        """The policy parameters alone (what `make_policy` takes)."""
        return BatchingConfig(**{f.name: getattr(self, f.name) for f in fields(BatchingConfig)})

    def to_engine(self) -> dict[str, Any]:
        """Plain values for vLLM's `additional_config` (JSON-hashed, sent to the engine process)."""
        return {"policy": self.policy, **dataclasses.asdict(self.batching())}

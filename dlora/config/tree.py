"""The whole config tree, `DloraConfig`: one instance of each section, the adapters registered at
start, the one check that spans sections, and the values that environment variables override."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dlora import env
from dlora.config.adapters import AdapterSpec
from dlora.config.batch import BatchConfig
from dlora.config.checks import check
from dlora.config.cluster import ClusterConfig
from dlora.config.engine import EngineConfig
from dlora.config.model import ModelConfig
from dlora.config.scheduling import SchedulingConfig
from dlora.config.server import ServerConfig
from dlora.config.slo import SloTargetsConfig


@dataclass(frozen=True)
class DloraConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    slo: SloTargetsConfig = field(default_factory=SloTargetsConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    adapters: tuple[AdapterSpec, ...] = ()

    def __post_init__(self) -> None:
        # Pinned adapters take entries of vLLM's host (CPU) LoRA cache (engine.max_cpu_loras) for good:
        # its LRU only evicts unpinned ones. Every engine step loads the batch's adapters, up to
        # engine.max_loras, into that cache, evicting the least recently used unpinned entry when it is
        # full; the batch's own adapters are the most recently used, so they are safe only while at
        # least max_loras entries are unpinned. With fewer, a batch of max_loras unpinned adapters evicts
        # (and deactivates) one of its own adapters to load another, and the engine dies (KeyError in
        # convert_mapping; "All items are pinned" when none is left). Unpinned adapters may outnumber
        # the cache freely: they are reloaded on demand. (Adapters pinned later through the admin API
        # take entries too, but are not known here.)
        pinned = [a.name for a in self.adapters if a.pinned]
        check(
            len(pinned) + self.engine.max_loras <= self.engine.max_cpu_loras,
            "engine.max_cpu_loras",
            self.engine.max_cpu_loras,
            f"must be >= engine.max_loras ({self.engine.max_loras}) + the {len(pinned)} pinned adapter(s) "
            f"{pinned}, which never leave the host LoRA cache (a batch needs max_loras unpinned entries)",
        )

    @property
    def state_dir(self) -> Path:
        return Path(os.path.expanduser(self.server.state_dir))

    @property
    def admin_token(self) -> str | None:
        return env.DLORA_ADMIN_TOKEN.get() or self.server.admin_token

    @property
    def api_key(self) -> tuple[str, ...]:
        """The keys the inference routes accept, any one of them; empty = open. DLORA_API_KEY, one
        key, replaces the configured ones."""
        key = env.DLORA_API_KEY.get()
        return (key,) if key else self.server.api_key

"""Frozen configuration dataclasses, filled from YAML and overridden by CLI flags.

One tree: `DloraConfig` (tree.py) holds `ModelConfig`, `EngineConfig`, `ServerConfig`,
`ClusterConfig`, `SchedulingConfig`, `SloTargetsConfig`, `BatchConfig` and the adapters registered
at start, one module per section. Relative paths in a YAML file are resolved against the directory
of that file (loading.py), so `dlora serve --config X` works from anywhere. Every public name is
importable from `dlora.config` itself.
"""

from dlora.config.adapters import AdapterSpec
from dlora.config.autoscale import AutoscaleConfig, parse_autoscale
from dlora.config.batch import BATCH_PLANNERS, BatchConfig
from dlora.config.checks import ConfigError
from dlora.config.cluster import DISPATCH_MODES, ClusterConfig
from dlora.config.engine import STRUCTURED_OUTPUTS_BACKENDS, EngineConfig
from dlora.config.loading import from_dict, load
from dlora.config.model import DEFAULT_MODEL, DTYPES, ModelConfig
from dlora.config.overrides import override
from dlora.config.scheduling import SchedulingConfig
from dlora.config.server import LOG_LEVELS, ServerConfig
from dlora.config.slo import SloTargetsConfig
from dlora.config.tree import DloraConfig

__all__ = [
    "BATCH_PLANNERS",
    "DEFAULT_MODEL",
    "DISPATCH_MODES",
    "DTYPES",
    "LOG_LEVELS",
    "STRUCTURED_OUTPUTS_BACKENDS",
    "AdapterSpec",
    "AutoscaleConfig",
    "BatchConfig",
    "ClusterConfig",
    "ConfigError",
    "DloraConfig",
    "EngineConfig",
    "ModelConfig",
    "SchedulingConfig",
    "ServerConfig",
    "SloTargetsConfig",
    "from_dict",
    "load",
    "override",
    "parse_autoscale",
]

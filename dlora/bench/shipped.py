"""What users get: sections of configs/default.yaml, which the benchmarks run as shipped or compare
against."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


def shipped_config(section: str) -> dict:
    """A section of configs/default.yaml: what users get."""
    return yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text()).get(section) or {}


def shipped_scheduling(policy: str, mixed_merged: bool = False) -> dict:
    """The policy with the parameters of configs/default.yaml's `scheduling:` (what users get)."""
    return {**shipped_config("scheduling"), "policy": policy, **({"mixed_merged": True} if mixed_merged else {})}


def shipped_batching_parameters() -> dict:
    """configs/default.yaml's `scheduling:` parameters without its policy: what a simulated `dlora`
    policy runs with."""
    section = dict(shipped_config("scheduling"))
    section.pop("policy", None)
    return section

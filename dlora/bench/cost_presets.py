"""The LoRA backend each of the simulators' step-cost presets (`dlora.sim.step_costs.PRESETS`)
stands for: the backend whose cost priors a simulated policy starts from
(`BatchingConfig.for_lora_backend`)."""

from __future__ import annotations

BACKEND_OF = {"cpu-einsum": "einsum", "cpu-vllm-ops": "vllm", "gpu-like": "triton"}

"""dlora's worker extension for vLLM (`worker_extension_cls`).

vLLM imports this module inside the engine's worker process before the model is built, which is
where dlora's fixes to vLLM's CPU LoRA path must be in force. Methods added here become RPCs that the
replica calls through `collective_rpc`; vLLM forbids overriding Worker attributes, so every name
carries a `dlora_` prefix.
"""

from __future__ import annotations

from dlora.replica import cpu_lora_fix

cpu_lora_fix.install()


class DloraWorkerExtension:
    def dlora_ping(self) -> str:
        """Proves the extension is mixed into the worker (used by tests and health checks)."""
        return "dlora"

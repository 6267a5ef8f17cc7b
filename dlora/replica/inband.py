"""In-band weight switching: what the scheduler attaches to a step and what the worker reports back.

The scheduler (`dlora_scheduler.py`, EngineCore process) sets `scheduler_output.dlora_cmds` on the
step whose batch needs new weights; the worker (`vllm_ext.py`) applies the commands before that
step's forward pass and sets `model_runner_output.dlora_reports`. Both objects are plain dataclasses
without slots, so the attributes also survive vLLM's multiprocess executor (pickled `__dict__`).
Commands of one step run in order (an UNMERGE always precedes a MERGE).
"""

from __future__ import annotations

from dataclasses import dataclass

CMDS_ATTR = "dlora_cmds"
REPORTS_ATTR = "dlora_reports"

MERGE = "merge"
UNMERGE = "unmerge"


@dataclass(frozen=True)
class SwitchCommand:
    op: str  # MERGE or UNMERGE
    adapter: str | None = None  # LoRA name (MERGE only)
    path: str | None = None  # adapter directory (MERGE only)
    lora_int_id: int = 0  # vLLM's id of the adapter, remapped to "no LoRA" while merged


@dataclass(frozen=True)
class SwitchReport:
    op: str
    adapter: str | None
    ok: bool
    seconds: float  # wall time the worker spent on it
    error: str | None = None

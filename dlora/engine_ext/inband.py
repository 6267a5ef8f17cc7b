"""In-band weight switching: what the scheduler attaches to a step and what the worker reports back.

Runs inside vLLM's EngineCore process (the scheduler's side) and worker process (the worker's side).

The scheduler (`scheduler.py`, EngineCore process) sets `scheduler_output.dlora_cmds` on the
step whose batch needs new weights; the worker (`worker.py`) applies the commands before that
step's forward pass and sets `model_runner_output.dlora_reports`. Both objects are plain dataclasses
without slots, so the attributes also survive vLLM's multiprocess executor (pickled `__dict__`).
Commands of one step run in order (an UNMERGE always precedes a MERGE).

Every command carries a sequence number that its report echoes: a report that arrives on a later
step's output than its command's is recognised as stale instead of being taken for that step's.
A report with `weights_known=False` says the worker cannot vouch for its weights (an unexpected
exception while switching); the scheduler then treats them as unknown, exactly as for a command
whose report never came (`weight_state.py`).
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
    seq: int = 0  # unique per scheduler (0: out of band)


@dataclass(frozen=True)
class SwitchReport:
    op: str
    adapter: str | None
    ok: bool
    seconds: float  # wall time the worker spent on it
    error: str | None = None
    seq: int = 0  # the command's
    weights_known: bool = True  # False: the worker cannot tell which weights it holds

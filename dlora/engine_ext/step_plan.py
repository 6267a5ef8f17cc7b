"""What one engine step runs and on which weights: the policy's decision made safe (pure; no vLLM import).

Runs inside vLLM's EngineCore process; `scheduler.py` calls these once per step over plain data
(`RequestView`s, the LoRA of each request, the engine's flags), in this order:
1. `checked_decision`: the policy's decision, or unmerged FCFS over everything when it breaks its
   contract (`check_decision`);
2. `select`: a merge is vetoed while the worker hooks are not installed or shortly after that
   adapter failed to merge; if the allowed requests cannot make progress (none running and no free
   slot, or the previous restricted step scheduled nothing) the step falls back to unmerged FCFS
   over everything; otherwise batch requests never share a step with online ones
   (`scheduling/background.py`);
3. (the scheduler's KV quotas and LoRA slot aging hide more waiting requests);
4. `fit_lora_slots`: running requests beyond `max_loras` distinct adapters wait (vLLM asserts on
   that, and hidden requests make it possible), and while an adapter is merged it holds one of
   those slots whether its requests run or not;
5. `switch_commands`: the in-band commands that take the worker from its weights to the step's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dlora.engine_ext.inband import MERGE, UNMERGE, SwitchCommand
from dlora.engine_ext.weight_state import Weights
from dlora.scheduling import Decision, Mode, RequestView, check_decision
from dlora.scheduling.background import without_background
from dlora.scheduling.dynamic_batching import fcfs_key

log = logging.getLogger(__name__)


class Lora(NamedTuple):
    """vLLM's LoRARequest fields a step's plan needs."""

    name: str
    int_id: int
    path: str


@dataclass
class Plan:
    """What this step runs: the visible requests (priority order) and the weights they need."""

    visible: list[str]
    target: Weights  # adapter merged for this step (None = base weights; UNKNOWN: restoring)
    cmds: list[SwitchCommand] = field(default_factory=list)


@dataclass(frozen=True)
class Guard:
    """What the engine allows this step, whatever the policy decided."""

    weights: str | None  # the adapter merged now (the weights are known: else the step restores them)
    switching: bool  # the worker hooks are installed: merges may run
    blocked: Collection[str]  # adapters whose merge failed recently: they run unmerged for now
    stalled: bool  # the previous step was restricted and scheduled nothing
    free_slot: bool  # the engine has room to admit a waiting request
    background_from: int | None  # engine priority from which requests are batch work (None: none are)


def unmerged_fcfs(views: Sequence[RequestView]) -> list[str]:
    return [v.req_id for v in sorted(views, key=fcfs_key)]


def checked_decision(policy, views: Sequence[RequestView], now: float, max_batch: int, mixing: bool) -> Decision:
    """The policy's decision for this step; unmerged FCFS over everything if it broke its contract."""
    decision = policy.decide(views, now, max_batch)
    try:
        check_decision(decision, views, max_batch, mixing)
    except ValueError as e:
        log.error("batching policy broke its contract (%s); running unmerged FCFS this step", e)
        decision = Decision(Mode.UNMERGED, None, tuple(unmerged_fcfs(views)))
    return decision


def can_progress(allowed: Sequence[str], running: Collection[str], free_slot: bool) -> bool:
    """False when the allowed requests cannot run at all (the engine would spin on empty steps)."""
    if not allowed:
        return False
    return any(i in running for i in allowed) or free_slot


def select(decision: Decision, views: Sequence[RequestView], guard: Guard) -> tuple[str | None, list[str]]:
    """(the adapter to merge for this step or None, the requests allowed to run, in order)."""
    target = decision.merged_adapter if decision.mode is Mode.MERGED else None
    allowed = list(decision.allowed_req_ids)
    if target is not None and target != guard.weights and (not guard.switching or target in guard.blocked):
        target = None  # run the adapter's requests unmerged; observe() tells the policy
    running = {v.req_id for v in views if v.running}
    if guard.stalled or not can_progress(allowed, running, guard.free_slot):
        return None, unmerged_fcfs(views)
    # Not after a step that ran nothing: online requests the KV held by paused batch work keeps
    # out would wait forever; that step runs everything (vLLM then preempts by priority).
    priority = {v.req_id: v.priority for v in views}
    return target, without_background(allowed, priority.__getitem__, guard.background_from)


def without(allowed: list[str], held: Collection[str]) -> list[str]:
    return [i for i in allowed if i not in held] if held else allowed


def fit_lora_slots(
    allowed: Sequence[str],
    loras: Mapping[str, Lora],
    running: Collection[str],
    max_loras: int | None,
    merged_id: int | None,
) -> list[str]:
    """`allowed` less the requests whose adapter would exceed `max_loras` distinct adapters this step.

    vLLM schedules every visible running request and asserts that they use at most max_loras
    adapters; with requests hidden, more adapters than that can be running. Waiting requests stay:
    vLLM's admission check counts adapters itself. Except while an adapter is merged (lora id
    `merged_id`): the worker keeps it in a slot whether its requests are scheduled or not (it
    compensates it, worker.py), which vLLM's admission does not count, so that slot is taken first
    and waiting requests count too. `loras`: the LoRA of each request that has one.
    """
    if max_loras is None:
        return list(allowed)
    taken: set[int] = set() if merged_id is None else {merged_id}
    kept = []
    for rid in allowed:
        lora = loras.get(rid)
        counted = rid in running or merged_id is not None
        if lora is not None and counted and lora.int_id not in taken:
            if len(taken) >= max_loras:
                continue
            taken.add(lora.int_id)
        kept.append(rid)
    return kept


def lora_named(loras: Mapping[str, Lora], adapter: str) -> Lora:
    """The LoRA of `adapter` (policies only merge an adapter that has requests)."""
    return next(lora for lora in loras.values() if lora.name == adapter)


def switch_commands(weights: str | None, target: Lora | None, next_seq: Callable[[], int]) -> list[SwitchCommand]:
    """The commands that take the worker from `weights` (the adapter merged now, None: the base) to
    `target` merged (None: the base), in the order the worker applies them."""
    name = target.name if target is not None else None
    if name == weights:
        return []
    cmds = []
    if weights is not None:
        cmds.append(SwitchCommand(UNMERGE, weights, seq=next_seq()))
    if target is not None:
        cmds.append(SwitchCommand(MERGE, target.name, target.path, target.int_id, next_seq()))
    return cmds

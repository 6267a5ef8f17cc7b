"""Which weights the worker holds after a step, as far as its reports tell (pure; no vLLM import).

Runs inside vLLM's EngineCore process.

The scheduler plans each step's weights and sends the switch commands in band (`inband.py`); only
the worker's reports say what happened. Whenever they do not say it for sure (a report that never
came, came a step late, or says `weights_known=False` after an unexpected exception) the weights
are `UNKNOWN`, never assumed to be the base: the worker may well still hold a merged adapter,
and every base or other-adapter request run on it would be computed, and its KV cached, on the
wrong weights. From `UNKNOWN` the scheduler runs nothing (`Restore`): it sends an UNMERGE, which
puts the pristine weights back whatever the worker holds, waits a step for its report if it is
late, sends it again if it is still missing, and gives up (`WeightsUnknown`, the engine stops)
after `Restore.max_attempts`. Only a report of that very UNMERGE, ok and known, brings the
weights back to the base.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from dlora.engine_ext.inband import UNMERGE, SwitchCommand, SwitchReport


class Unknown:
    """The type of `UNKNOWN` (its only instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = Unknown()
Weights = str | None | Unknown  # an adapter merged, None for the base weights, or UNKNOWN


class WeightsUnknown(RuntimeError):
    """The worker never confirmed the base weights back: serving on must not go on."""


def split_reports(
    cmds: Sequence[SwitchCommand], reports: Iterable[SwitchReport]
) -> tuple[list[SwitchReport], list[SwitchReport]]:
    """(the reports of `cmds`, the others: late reports of earlier steps), by sequence number."""
    seqs = {c.seq for c in cmds}
    mine: list[SwitchReport] = []
    other: list[SwitchReport] = []
    for r in reports:
        (mine if r.seq in seqs else other).append(r)
    return mine, other


def weights_after(cmds: Sequence[SwitchCommand], reports: Sequence[SwitchReport], planned: Weights) -> Weights:
    """The weights after a step that planned `planned` and sent `cmds`; `reports`: those of `cmds`."""
    if not cmds:
        return planned
    if len(reports) != len(cmds) or any(not r.weights_known for r in reports):
        return UNKNOWN
    if any(not r.ok for r in reports):
        return None  # a failed merge (MergeError) leaves the base weights in
    return planned


@dataclass
class Restore:
    """Bringing `UNKNOWN` weights back to the base (module docstring)."""

    max_attempts: int = 3  # UNMERGEs sent before giving up
    wait_steps: int = 1  # steps waited for a late report before sending the UNMERGE again
    seq: int | None = None  # the UNMERGE waited for
    waited: int = 0
    attempts: int = 0

    def command(self, next_seq: Callable[[], int]) -> SwitchCommand | None:
        """This step's command: a new UNMERGE, or None while the last one's report may be late."""
        if self.seq is not None and self.waited < self.wait_steps:
            self.waited += 1
            return None
        if self.attempts >= self.max_attempts:
            raise WeightsUnknown(f"the worker confirmed none of {self.attempts} restores of the base weights")
        self.attempts += 1
        self.seq, self.waited = next_seq(), 0
        return SwitchCommand(UNMERGE, seq=self.seq)

    def settle(self, reports: Iterable[SwitchReport]) -> bool:
        """True if `reports` confirm the base weights; a failed restore is sent again next step."""
        for r in reports:
            if self.seq is not None and r.seq == self.seq:
                if r.ok and r.weights_known:
                    return True
                self.seq = None  # reported, but not restored: no use waiting for it
        return False

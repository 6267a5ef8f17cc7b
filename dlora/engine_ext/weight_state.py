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

`WeightTracker` is the scheduler's whole account of the worker's weights: what they are, the
switches applied and their times, failed merges and the restores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from dlora.engine_ext.inband import MERGE, UNMERGE, SwitchCommand, SwitchReport
from dlora.engine_ext.switch_times import SwitchHistogram

log = logging.getLogger(__name__)

MERGE_RETRY_S = 30.0  # after a failed merge, that adapter runs unmerged for this long


class Unknown:
    """The type of `UNKNOWN` (its only instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = Unknown()
Weights = str | None | Unknown  # an adapter merged, None for the base weights, or UNKNOWN


def known(weights: Weights) -> str | None:
    """The adapter merged, for what only knows adapters and the base (the policy, traces)."""
    return None if isinstance(weights, Unknown) else weights


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


class WeightTracker:
    """The weights the worker holds as the scheduler knows them, and how they got there."""

    def __init__(self) -> None:
        self.weights: Weights = None  # adapter merged on the worker
        self.restore: Restore | None = None  # set while the weights are UNKNOWN
        self.seq = 0  # of the last switch command sent
        self.restores = 0  # times the weights were unknown and restored
        self.switches = 0  # merges and unmerges applied
        self.failures = 0  # merges and unmerges the worker reported failed
        self.blocked: dict[str, float] = {}  # adapter -> monotonic time it may merge again
        self.times = {MERGE: SwitchHistogram(), UNMERGE: SwitchHistogram()}

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def restore_commands(self) -> list[SwitchCommand]:
        """This step's command while the weights are unknown (raises WeightsUnknown at the end)."""
        assert self.restore is not None  # set whenever the weights become UNKNOWN
        cmd = self.restore.command(self.next_seq)
        return [cmd] if cmd is not None else []

    def blocked_at(self, now: float) -> frozenset[str]:
        """Adapters that failed to merge less than MERGE_RETRY_S before `now` (monotonic)."""
        return frozenset(a for a, until in self.blocked.items() if now < until)

    def state(self) -> str:
        """One of `dlora.replica.messages.WEIGHT_STATES`: restoring once the restore's first UNMERGE
        went out (at the engine's next step, so an idle engine's weights stay unknown)."""
        if self.weights is UNKNOWN:
            return "restoring" if self.restore is not None and self.restore.attempts > 0 else "unknown"
        return "unmerged" if self.weights is None else "merged"

    def observe(
        self, cmds: Sequence[SwitchCommand], planned: Weights, received: Sequence[SwitchReport], now: float
    ) -> list[SwitchReport]:
        """A step that planned `planned` and sent `cmds` ended with the worker's reports `received`
        (`now`: monotonic); returns the reports of `cmds`."""
        reports, late = split_reports(cmds, received)
        restoring = planned is UNKNOWN
        if restoring:
            self._settle(received)
        else:
            self.weights = weights_after(cmds, reports, planned)
            if self.weights is UNKNOWN:
                log.error(
                    "the worker did not confirm dlora switch command(s) %s (reports: %s); its weights are "
                    "unknown: nothing runs until the base weights are restored",
                    cmds,
                    reports,
                )
                self.restore = Restore()
        if late and not restoring:  # while restoring, the restore's own late report settles it
            log.warning("ignoring %d dlora switch report(s) of earlier steps: %s", len(late), late)
        for report in reports:
            if report.ok:
                self.switches += 1
                self.times[report.op].observe(report.seconds)
            else:
                self.failures += 1
                if report.op == MERGE and report.adapter is not None:
                    self.blocked = {a: until for a, until in self.blocked.items() if now < until}
                    self.blocked[report.adapter] = now + MERGE_RETRY_S
        return reports

    def _settle(self, received: Sequence[SwitchReport]) -> None:
        assert self.restore is not None  # a restoring step runs only while one is set
        if self.restore.settle(received):
            log.warning("dlora: the base weights are restored and confirmed; serving resumes")
            self.weights, self.restore = None, None
            self.restores += 1

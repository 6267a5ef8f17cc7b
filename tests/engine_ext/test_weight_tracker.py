"""The scheduler's account of the worker's weights (`weight_state.WeightTracker`), as the replica's
state reports it: unmerged, merged, unknown (a switch unconfirmed) and restoring (its UNMERGE sent)."""

from __future__ import annotations

from dlora.engine_ext.inband import MERGE, UNMERGE, SwitchCommand, SwitchReport
from dlora.engine_ext.weight_state import MERGE_RETRY_S, UNKNOWN, WeightTracker


def report(cmd: SwitchCommand, ok: bool = True, known: bool = True, seconds: float = 0.01) -> SwitchReport:
    return SwitchReport(cmd.op, cmd.adapter, ok, seconds, seq=cmd.seq, weights_known=known)


def test_the_weight_state_through_a_merge_a_lost_report_and_the_restore():
    w = WeightTracker()
    assert w.state() == "unmerged"
    merge = SwitchCommand(MERGE, "a0", "/a0", 1, w.next_seq())
    assert w.observe([merge], "a0", [report(merge)], now=0.0) == [report(merge)]
    assert (w.state(), w.switches, w.times[MERGE].count) == ("merged", 1, 1)
    unmerge = SwitchCommand(UNMERGE, "a0", seq=w.next_seq())
    w.observe([unmerge], None, [], now=1.0)  # its report never came
    assert w.weights is UNKNOWN and w.state() == "unknown"  # nothing sent yet (an idle engine)
    (restore,) = w.restore_commands()
    w.weights = UNKNOWN  # what the scheduler plans for the restoring step
    assert w.state() == "restoring"
    w.observe([restore], UNKNOWN, [], now=2.0)  # its report is late: still restoring
    assert w.state() == "restoring" and w.restores == 0
    assert w.restore_commands() == []  # waits a step for the late report
    w.observe([], UNKNOWN, [report(restore)], now=3.0)
    assert (w.state(), w.weights, w.restores) == ("unmerged", None, 1)


def test_a_failed_merge_leaves_the_base_and_blocks_the_adapter_for_a_while():
    w = WeightTracker()
    merge = SwitchCommand(MERGE, "a0", "/a0", 1, w.next_seq())
    w.observe([merge], "a0", [report(merge, ok=False)], now=10.0)
    assert (w.state(), w.failures, w.switches) == ("unmerged", 1, 0)
    assert w.blocked_at(10.0 + MERGE_RETRY_S - 1) == {"a0"} and not w.blocked_at(10.0 + MERGE_RETRY_S)

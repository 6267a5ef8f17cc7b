"""Resident memory of a process tree, read from /proc: what a benchmark records beside its times."""

from __future__ import annotations

from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def rss_gib(pid: int) -> dict:
    """Resident memory of `pid` and its descendants (GiB): in all, and each vLLM engine process's."""
    total, engines, todo = 0.0, [], [pid]
    while todo:
        current = todo.pop()
        todo += _children(current)
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = int(fields.get("VmRSS", "0 kB").split()[0]) / 2**20
        total += rss
        if "EngineCor" in fields.get("Name", ""):  # /proc truncates names to 15 characters
            engines.append(round(rss, 3))
    return {"total": round(total, 3), "engine_processes": engines}

"""dlora as configs/default.yaml ships at an older commit vs this checkout, one server up at a time.

Why one at a time: two default configs (two engines each) do not fit beside each other in 24 GiB,
and a fresh server per rep also measures what a fresh start costs (cold adapter loads). Each rep
starts each commit's server in turn, on the same port, the order alternating so each sees the same
background load on average; it is warmed, measured and stopped before the other starts. The older
commit runs from a git worktree (`source_tree.py`) with the same interpreter and packages.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from dlora.bench.provenance import git_commit
from dlora.bench.server_comparison import rotated
from dlora.bench.server_configs import shipped_server_config
from dlora.bench.servers import stop, wait_healthy
from dlora.bench.shipped import REPO_ROOT
from dlora.bench.source_tree import check_imported, ensure_worktree, serve_from

Launch = Callable[[], subprocess.Popen]


def commit_trees(old_commit: str) -> tuple[dict[str, Path], dict[str, str]]:
    """The checkouts to serve, {"old": its worktree (made when absent), "new": this checkout},
    and their full commit ids."""
    old_tree = Path(f"/tmp/dlora-{old_commit}")
    commits = {"old": ensure_worktree(REPO_ROOT, old_commit, old_tree), "new": git_commit()}
    return {"old": old_tree, "new": REPO_ROOT}, commits


def shipped_launchers(
    trees: Mapping[str, Path], port: int, work: Path, adjust: Callable[[dict, Path], dict] = lambda cfg, state: cfg
) -> dict[str, Launch]:
    """Per tree, a launch of its own configs/default.yaml on `port` with a fresh state directory
    (the node cache inside it), after `adjust(cfg, state_dir)`."""

    def launcher(name: str, tree: Path) -> Launch:
        def launch() -> subprocess.Popen:
            state = work / f"state-{name}-{time.time_ns()}"
            cfg = shipped_server_config(port, str(state), root=tree)
            cfg = adjust(cfg, state)
            path = work / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            return serve_from(tree, path, work / f"{name}.log")

        return launch

    return {name: launcher(name, tree) for name, tree in trees.items()}


def fresh_server_runs(
    launchers: Mapping[str, Launch],
    url: str,
    work: Path,
    reps: int,
    measure: Callable[[str], dict],
    warm: Callable[[str], object] | None = None,
    sources: Mapping[str, Path] | None = None,
) -> dict[str, list[dict]]:
    """`reps` runs per server, each on a server started for it (the order rotating per rep):
    start, wait until healthy (its `startup_s` recorded), `warm`, `measure`, stop. With `sources`,
    a server that imported dlora from elsewhere than its tree fails the run."""
    names = list(launchers)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        for name in rotated(names, rep):
            t0 = time.monotonic()
            proc = launchers[name]()
            log = work / f"{name}.log"
            try:
                wait_healthy(url, proc, log, timeout=1200)
                startup = time.monotonic() - t0
                if sources is not None:
                    check_imported(name, sources[name], log)
                if warm is not None:
                    warm(url)
                m = measure(url)
            finally:
                stop(proc)
            m |= {"startup_s": startup, "loadavg_1m": os.getloadavg()[0]}
            runs[name].append(m)
            print(f"rep {rep} {name}: {brief(m)}", flush=True)
    return runs


def brief(m: Mapping[str, object]) -> str:
    """One progress line's worth of a measurement: numbers to 3 digits, lists by their length."""
    return ", ".join(f"{k} {brief_value(v)}" for k, v in m.items())


def brief_value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, Mapping):
        return "{" + brief(v) + "}"
    if isinstance(v, list | tuple):
        return f"[{len(v)} items]"
    return str(v)

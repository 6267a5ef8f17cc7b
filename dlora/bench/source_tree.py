"""dlora served from another checkout of this repository (a `git worktree` of an older commit),
with the same interpreter and installed packages, so a benchmark can compare two versions of the
code side by side. The checkout goes first on PYTHONPATH and is the working directory, so `import
dlora` resolves there in the API process and in the Ray workers it starts (they inherit both)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

IMPORTED_FROM = "dlora imported from "

# Says which dlora it imported before anything else runs, then is `dlora ...` with the given arguments.
BOOT = (
    "import sys, dlora; "
    f"print({IMPORTED_FROM!r} + dlora.__file__, flush=True); "
    "from dlora.cli import main; sys.exit(main(sys.argv[1:]))"
)


def ensure_worktree(repo: Path, commit: str, path: Path) -> str:
    """A detached worktree of `commit` at `path` (made when absent); its full commit id.

    Raises when `path` exists at another commit: a stale or hand-edited tree would be measured as
    `commit`."""
    if not path.exists():
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(path), commit], check=True)
    want = _rev_parse(repo, commit)
    have = _rev_parse(path, "HEAD")
    if have != want:
        raise RuntimeError(f"{path} is at {have}, not {commit} ({want})")
    return want


def _rev_parse(repo: Path, rev: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", rev], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def serve_from(source: Path, config: Path, log: Path) -> subprocess.Popen:
    """`dlora serve --config config` with `source`'s dlora package, output to `log`."""
    cmd = [sys.executable, "-c", BOOT, "serve", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH")) if p)}
    print(f"$ (cd {shlex.quote(str(source))} && PYTHONPATH={shlex.quote(str(source))} {shlex.join(cmd)})", flush=True)
    return subprocess.Popen(
        cmd, cwd=source, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def imported_from(log: Path) -> str | None:
    """The dlora/__init__.py the server started by `serve_from` imported, from its log."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(IMPORTED_FROM):
            return line.removeprefix(IMPORTED_FROM).strip()
    return None


def check_imported(name: str, source: Path, log: Path) -> str:
    """The dlora/__init__.py the server `name` started by `serve_from` imported; RuntimeError when it
    is not under `source` (a stale install or PYTHONPATH would measure the wrong code)."""
    imported = imported_from(log)
    if imported is None or not Path(imported).resolve().is_relative_to(source.resolve()):
        raise RuntimeError(f"{name} imported dlora from {imported}, not from {source}; see {log}")
    return imported


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Ray's raylet and its workers included), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def tree_sources(pid: int) -> dict[str, list[str]]:
    """The Python processes of `pid`'s tree (itself, Ray's workers, vLLM's engine cores) by the first
    entry of their PYTHONPATH ("" for none), each as its command name. Processes of other programs
    (Ray's raylet and GCS server) are left out: they do not import dlora."""
    out: dict[str, list[str]] = {}
    for p in [pid, *descendants(pid)]:
        try:
            if not os.path.basename(os.readlink(f"/proc/{p}/exe")).startswith("python"):
                continue
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            name = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        paths = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"PYTHONPATH=")]
        first = paths[0].split(os.pathsep)[0] if paths else ""
        out.setdefault(first, []).append(name)
    return out

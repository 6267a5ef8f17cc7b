"""Memory of a process tree, read from /proc: what a benchmark records beside its times.

Two measures: resident memory (RSS, `rss_gib`), and proportional set size (PSS: a shared page
counted once in all, split between the processes that map it), which is what a tree of processes
that share libraries really costs the machine. PSS is broken down per process and, inside one,
per group of mappings (`mapping_group`): heap, malloc arenas, the KV cache, file-backed libraries
and weights, so a footprint can be traced to what holds it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
KIB = 1 << 10
# glibc's thread arenas are HEAP_MAX_SIZE (64 MiB on 64-bit) reservations aligned to their size
ARENA_BYTES = 64 * MIB
# Anonymous mappings at least this large hold single tensors (glibc's largest dynamic mmap
# threshold is 32 MiB: anything smaller may sit inside the heap or an arena instead)
LARGE_ANON_BYTES = 32 * MIB


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, parents before their children."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        todo += _children(current)
    return out


def rss_gib(pid: int) -> dict:
    """Resident memory of `pid` and its descendants (GiB): in all, and each vLLM engine process's."""
    total, engines = 0.0, []
    for current in descendants(pid):
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


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/<pid>/maps with its smaps sizes (bytes)."""

    start: int
    end: int
    perms: str
    path: str
    pss: int
    rss: int
    swap: int

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def anonymous(self) -> bool:
        return self.path == "" or self.path.startswith("[anon")


_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of a /proc/<pid>/smaps text, in address order."""
    out: list[Mapping] = []
    header: tuple[int, int, str, str] | None = None
    sizes: dict[str, int] = {}

    def flush() -> None:
        if header is not None:
            out.append(Mapping(*header, sizes.get("Pss", 0), sizes.get("Rss", 0), sizes.get("Swap", 0)))

    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            flush()
            header, sizes = (int(m[1], 16), int(m[2], 16), m[3], m[4].strip()), {}
            continue
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            sizes[key] = int(parts[0]) * KIB
    flush()
    return out


def parse_rollup(text: str) -> dict[str, int]:
    """The kB fields of /proc/<pid>/smaps_rollup, in bytes (Rss, Pss, Pss_Anon, Pss_File, ...)."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * KIB
    return out


_LIBRARY = re.compile(r"\.so(\.[0-9.]+)?$")
_OPENMP_ONEDNN = ("libgomp", "libiomp", "libomp", "dnnl", "onednn", "libmkl")
_WEIGHT_FILES = (".safetensors", ".bin", ".gguf", ".pt")


def mapping_group(m: Mapping) -> str:
    """What a mapping holds, by its path, permissions, size and alignment (anonymous ones)."""
    path = m.path
    if path == "[heap]":
        return "heap"
    if path == "[stack]":
        return "stack"
    if path.startswith("[") and not path.startswith("[anon"):
        return "kernel"  # [vdso], [vvar], [vsyscall]
    if m.perms[3] == "s" or path.startswith("/dev/shm") or path.startswith("/memfd:"):
        return "shared_memory"
    if m.anonymous:
        if m.start % ARENA_BYTES == 0 and m.size <= ARENA_BYTES:
            return "malloc_arenas"
        return "anon_large" if m.size >= LARGE_ANON_BYTES else "anon_small"
    name = path.rsplit("/", 1)[-1]
    if path.endswith(_WEIGHT_FILES):
        return "adapter_files" if "adapter" in name else "model_files"
    if _LIBRARY.search(path):
        if any(k in name for k in _OPENMP_ONEDNN):
            return "lib_openmp_onednn"
        if "/torch/" in path:
            return "lib_torch"  # oneDNN and its prepacking kernels are linked into libtorch_cpu
        if "/vllm/" in path:
            return "lib_vllm"
        return "lib_other"
    return "file_other"


def group_pss(mappings: Iterable[Mapping], kv_bytes: int = 0) -> dict[str, int]:
    """PSS (bytes) per `mapping_group`, largest first. With `kv_bytes`, the first anonymous mapping
    at least that large holds the KV cache: that much of its PSS is `kv_cache`, the rest (tensors
    the kernel merged into the same mapping) stays `anon_large`."""
    out: dict[str, int] = {}
    kv_left = kv_bytes
    for m in mappings:
        group = mapping_group(m)
        if kv_left and group == "anon_large" and m.size >= kv_bytes:
            kv = min(kv_left, m.pss)
            out["kv_cache"] = out.get("kv_cache", 0) + kv
            kv_left -= kv
            out[group] = out.get(group, 0) + m.pss - kv
            continue
        out[group] = out.get(group, 0) + m.pss
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def process_role(pid: int, root: int, comm: str, cmdline: str) -> str:
    """What a process of a dlora server's tree is, from its name and command line."""
    if pid == root:
        return "server"
    named = {
        "VLLM::EngineCor": "engine_core",
        "ray::ReplicaAct": "replica_actor",
        "raylet": "raylet",
        "gcs_server": "ray_gcs",
        "ray::DashboardA": "ray_dashboard_agent",
        "ray::RuntimeEnv": "ray_runtime_env_agent",
        "ray::IDLE": "ray_idle_worker",
    }
    for prefix, role in named.items():
        if comm.startswith(prefix):
            return role
    scripts = {
        "dashboard/dashboard.py": "ray_dashboard",
        "log_monitor.py": "ray_log_monitor",
        "autoscaler/_private/monitor.py": "ray_monitor",
        "resource_tracker": "resource_tracker",
    }
    for script, role in scripts.items():
        if script in cmdline:
            return role
    return f"other:{comm}"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:  # the process ended, or is not ours to read
        return None


def process_pss(pid: int, root: int, kv_bytes: int = 0) -> dict | None:
    """One process's PSS and RSS (MiB), its PSS by kind of page and by mapping group; None if gone."""
    rollup, smaps, comm = _read(f"/proc/{pid}/smaps_rollup"), _read(f"/proc/{pid}/smaps"), _read(f"/proc/{pid}/comm")
    raw_cmd = _read(f"/proc/{pid}/cmdline")
    if rollup is None or smaps is None or comm is None or raw_cmd is None:
        return None
    sizes = parse_rollup(rollup)
    role = process_role(pid, root, comm.strip(), raw_cmd.replace("\0", " "))
    groups = group_pss(parse_smaps(smaps), kv_bytes if role == "engine_core" else 0)
    return {
        "pid": pid,
        "role": role,
        "pss_mib": _mib(sizes.get("Pss", 0)),
        "rss_mib": _mib(sizes.get("Rss", 0)),
        "pss_anon_mib": _mib(sizes.get("Pss_Anon", 0)),
        "pss_file_mib": _mib(sizes.get("Pss_File", 0)),
        "pss_shmem_mib": _mib(sizes.get("Pss_Shmem", 0)),
        "swap_mib": _mib(sizes.get("Swap", 0)),
        "groups_mib": {g: _mib(b) for g, b in groups.items()},
    }


def tree_pss(pid: int, kv_bytes: int = 0) -> dict:
    """PSS of `pid` and its descendants (MiB): in all, per role (server, engine_core, raylet, ...)
    and per process with its mapping groups. `kv_bytes`: an engine's KV cache size (`group_pss`)."""
    processes = [p for p in (process_pss(q, pid, kv_bytes) for q in descendants(pid)) if p is not None]
    by_role: dict[str, float] = {}
    for p in processes:
        by_role[p["role"]] = round(by_role.get(p["role"], 0.0) + p["pss_mib"], 1)
    return {
        "total_pss_mib": round(sum(p["pss_mib"] for p in processes), 1),
        "by_role_mib": dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
        "processes": processes,
    }


def _mib(n: int) -> float:
    return round(n / MIB, 1)

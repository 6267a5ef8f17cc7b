"""PSS per process and per group of mappings, from /proc (dlora/bench/memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from dlora.bench.memory import (
    MIB,
    Mapping,
    descendants,
    group_pss,
    mapping_group,
    parse_rollup,
    parse_smaps,
    process_role,
    rss_gib,
    tree_pss,
)

SMAPS = """\
55d0a0000000-55d0a8000000 rw-p 00000000 00:00 0                          [heap]
Size:             131072 kB
Rss:              131072 kB
Pss:              131072 kB
Swap:                  0 kB
7f0000000000-7f0002000000 rw-p 00000000 00:00 0
Size:              32768 kB
Rss:               32768 kB
Pss:               32768 kB
7f1000000000-7f1088000000 rw-p 00000000 00:00 0
Size:            2228224 kB
Rss:             2228224 kB
Pss:             2228224 kB
7f2000000000-7f2000100000 r-xp 00000000 08:01 12 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                1024 kB
Pss:                 512 kB
7f2000200000-7f2000300000 r-xp 00000000 08:01 13 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1
Size:               1024 kB
Rss:                 100 kB
Pss:                 100 kB
7f3000000000-7f3010000000 r--p 00000000 08:01 14 /cache/models/smollm2/model.safetensors
Size:             262144 kB
Rss:              180224 kB
Pss:              180224 kB
7f3100000000-7f3100001000 rw-s 00000000 00:05 15 /dev/shm/plasma
Size:                  4 kB
Rss:                   4 kB
Pss:                   4 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
Rss:                  16 kB
Pss:                  16 kB
"""


def test_parse_smaps_reads_every_mapping_with_its_sizes():
    maps = parse_smaps(SMAPS)
    assert len(maps) == 8
    heap = maps[0]
    assert (heap.path, heap.size, heap.pss, heap.rss, heap.swap) == ("[heap]", 128 * MIB, 128 * MIB, 128 * MIB, 0)
    assert maps[1].anonymous and maps[1].path == ""
    assert maps[3].pss == 512 * 1024


def test_groups_by_path_size_and_alignment():
    groups = [mapping_group(m) for m in parse_smaps(SMAPS)]
    assert groups == [
        "heap",
        "malloc_arenas",  # 64 MiB-aligned, at most 64 MiB: a glibc thread arena
        "anon_large",
        "lib_torch",
        "lib_openmp_onednn",
        "model_files",
        "shared_memory",
        "stack",
    ]
    small = Mapping(0x7F0000001000, 0x7F0000002000, "rw-p", "", 4096, 4096, 0)
    assert mapping_group(small) == "anon_small"
    adapter = Mapping(0, 4096, "r--p", "/a/upper/adapter_model.safetensors", 4096, 4096, 0)
    assert mapping_group(adapter) == "adapter_files"


def test_the_kv_cache_is_split_out_of_the_mapping_that_holds_it():
    # 2 GiB of KV with a 128 MiB tensor the kernel merged into the same anonymous mapping
    groups = group_pss(parse_smaps(SMAPS), kv_bytes=2 << 30)
    assert groups["kv_cache"] == 2 << 30
    assert groups["anon_large"] == 2228224 * 1024 - (2 << 30)
    assert groups["heap"] == 128 * MIB
    assert sum(groups.values()) == sum(m.pss for m in parse_smaps(SMAPS))
    assert "kv_cache" not in group_pss(parse_smaps(SMAPS))


def test_parse_rollup_in_bytes():
    text = "00400000-7ffd ---p 00000000 00:00 0  [rollup]\nRss:  2048 kB\nPss:  1024 kB\nPss_Anon:  1000 kB\n"
    assert parse_rollup(text) == {"Rss": 2 * MIB, "Pss": MIB, "Pss_Anon": 1000 * 1024}


def test_roles_of_a_dlora_tree():
    assert process_role(10, 10, "python", "dlora serve") == "server"
    assert process_role(11, 10, "VLLM::EngineCor", "VLLM::EngineCore") == "engine_core"
    assert process_role(12, 10, "ray::ReplicaAct", "ray::ReplicaActor") == "replica_actor"
    assert process_role(13, 10, "python", "python .../ray/dashboard/dashboard.py --host") == "ray_dashboard"
    assert process_role(14, 10, "gcs_server", "gcs_server --log_dir") == "ray_gcs"
    assert process_role(15, 10, "cat", "cat") == "other:cat"


def test_tree_pss_reads_this_process_and_its_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = os.getpid()
        assert descendants(me)[0] == me and child.pid in descendants(me)
        tree = tree_pss(me)
        pids = {p["pid"]: p for p in tree["processes"]}
        assert pids[me]["role"] == "server" and child.pid in pids
        assert pids[me]["pss_mib"] > 1
        # the groups of a process add up to its PSS (up to rounding of each group)
        assert abs(sum(pids[me]["groups_mib"].values()) - pids[me]["pss_mib"]) < 1
        assert tree["total_pss_mib"] == round(sum(p["pss_mib"] for p in tree["processes"]), 1)
        assert rss_gib(me)["total"] > 0
    finally:
        child.kill()
        child.wait()

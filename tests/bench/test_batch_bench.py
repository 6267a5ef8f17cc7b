"""The offline-batch benchmark's progress line, read from `dlora batch run`'s log."""

from bench.batch.run import last_progress


def test_last_progress_reads_the_batch_bar_and_its_eta() -> None:
    log = (
        "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  5.01it/s]\n"
        "  0%|          | 0/2000 [00:00<?, ?req/s]\r"
        " 41%|####      | 812/2000 [10:01<14:40,  1.35req/s, plan ETA 620 s]\r"
        " 41%|####      | 813/2000 [10:02<14:40,  1.47s/req, plan ETA 611 s]\n"
        "2026-11-29 09:24:25,852 INFO dlora.batch.execute: batch plan for 1796 lines\n"
    )
    assert last_progress(log) == "813/2000 lines, plan ETA 611 s"


def test_last_progress_ignores_other_bars_and_waits_for_its_own() -> None:
    assert last_progress("Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  5.01it/s]") is None
    assert last_progress("  0%|          | 0/40 [00:00<?, ?req/s]") == "0/40 lines"

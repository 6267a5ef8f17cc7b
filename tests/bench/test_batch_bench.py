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


def test_replay_at_replan_censors_running_lines_so_they_run_to_their_cap() -> None:
    from bench.batch.replay import at_replan
    from dlora.batch.predict import RequestWork
    from dlora.cluster.estimators.survival import UNBOUNDED

    works = [RequestWork("a", 10, 100)] * 4
    lengths = [5, 100, 100, 100]  # one stopped early; three will run to their max_tokens
    ended = [True, False, False, False]
    # after 10 tokens: one line ended at 5, three run on, only known to be longer than 10
    drawn = at_replan(works, lengths, ended, running=4, generated=10)("a")
    assert set(drawn) == {5, UNBOUNDED} and drawn.count(5) == len(drawn) // 4


def test_replay_loads_each_line_with_its_true_length(tmp_path) -> None:
    import json

    from bench.batch.replay import load

    line = {"custom_id": "r0", "body": {"model": "a3", "max_tokens": 50}}
    body = {"usage": {"prompt_tokens": 12, "completion_tokens": 7}, "choices": [{"finish_reason": "stop"}]}
    out = {"custom_id": "r0", "response": {"body": body}}
    (tmp_path / "input.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "x.out.jsonl").write_text(json.dumps(out) + "\n")
    works, lengths, ended = load(tmp_path, "x.out.jsonl")
    assert [(w.adapter, w.prompt_tokens, w.max_tokens) for w in works] == [("a3", 12, 50)]
    assert lengths == [7] and ended == [True]

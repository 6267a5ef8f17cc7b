"""The alternation every server comparison uses: warm-up, rotating order, each server's own requests."""

from __future__ import annotations

from dlora.bench.server_comparison import alternate_runs, rotated


def test_every_server_is_first_middle_and_last_equally_often():
    assert [rotated(["a", "b", "c"], rep) for rep in range(3)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [rotated(["a", "b"], rep) for rep in range(2)] == [["a", "b"], ["b", "a"]]  # two: alternating


def test_runs_rotate_warm_once_and_send_each_server_its_own_requests():
    calls: list[tuple[str, tuple]] = []

    def run_once(url, requests):
        calls.append((url, tuple(requests)))
        return {"output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0}

    urls = {"x": "http://x", "y": "http://y", "z": "http://z"}
    sent = {"x": [1, 2, 3], "y": [1, 2, 3], "z": [4, 5, 6]}
    runs = alternate_runs(urls, sent, 2, run_once, warmup=1)
    assert calls[:3] == [("http://x", (1,)), ("http://y", (1,)), ("http://z", (4,))]
    assert [u for u, _ in calls[3:]] == ["http://x", "http://y", "http://z", "http://y", "http://z", "http://x"]
    assert all(reqs == tuple(sent[u[-1]]) for u, reqs in calls[3:])
    assert {n: len(r) for n, r in runs.items()} == {"x": 2, "y": 2, "z": 2}
    calls.clear()
    alternate_runs({"x": "http://x"}, [7, 8], 1, run_once, warmup=0)  # one list for all, no warm-up
    assert calls == [("http://x", (7, 8))]

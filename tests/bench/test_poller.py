"""MetricsPoller against a real HTTP server (a stdlib one started here): samples during the run."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.slo.run import fairness_gap, gap_summary
from dlora.bench.poller import MetricsPoller

GAPS = iter([3.0, 5.0, 4.0] + [4.0] * 1000)


class Metrics(BaseHTTPRequestHandler):
    def do_GET(self):
        body = f'dlora_kv_fairness_gap{{replica="0"}} {next(GAPS)}\ndlora_kv_fairness_gap{{replica="1"}} 1.0\n'
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_the_poller_samples_the_largest_gap_at_each_scrape_while_the_run_lasts():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with MetricsPoller(f"http://127.0.0.1:{server.server_port}", fairness_gap, every_s=0.02) as poller:
            deadline = time.monotonic() + 60  # a hang guard only: three scrapes take ~0.06 s
            while len(poller.samples) < 3:
                assert time.monotonic() < deadline, poller.samples
                time.sleep(0.01)
        n = len(poller.samples)
        time.sleep(0.1)
        assert len(poller.samples) == n  # stopped with the run
    finally:
        server.shutdown()
    assert n >= 3 and poller.samples[:3] == [3.0, 5.0, 4.0]
    got = gap_summary(poller.samples)
    assert got["kv_fairness_gap_max"] == 5.0 and got["kv_fairness_gap_samples"] == n


def test_a_scrape_without_the_gauge_is_no_sample():
    assert fairness_gap("dlora_requests_total 3\n") is None
    assert gap_summary([]) == {"kv_fairness_gap_mean": None, "kv_fairness_gap_max": None, "kv_fairness_gap_samples": 0}

"""Scrapes a server's /metrics at a fixed period in a thread while a benchmark's load runs.

Gauges such as a replica's state or the fairness gap describe the moment of the scrape; read after a
run they show an idle server, so a benchmark samples them during the run instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from dlora.bench.scrape import scrape


class MetricsPoller:
    """`with MetricsPoller(url, read) as p: <run>`: every `every_s`, `read(text, t)` turns one scrape
    (t: seconds since the poller started) into a sample for `p.samples`; None keeps nothing. A
    failed scrape is a missing sample, not a failed run."""

    def __init__(self, url: str, read: Callable[[str, float], Any], every_s: float = 1.0) -> None:
        self.url, self.read, self.every_s = url, read, every_s
        self.samples: list[Any] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MetricsPoller:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            try:
                text = scrape(self.url, timeout=5)
            except httpx.HTTPError:
                text = None
            if text is not None:
                sample = self.read(text, round(time.monotonic() - self.t0, 2))
                if sample is not None:
                    self.samples.append(sample)
            if self._stop.wait(self.every_s):
                return

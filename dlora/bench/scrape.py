"""A server's Prometheus /metrics: one scrape, and the samples a benchmark reads from its text."""

from __future__ import annotations

import re

import httpx


def scrape(url: str, timeout: float = 30) -> str:
    """The /metrics text of the server at `url`."""
    return httpx.get(f"{url}/metrics", timeout=timeout).text


def metric_values(text: str, name: str) -> list[float]:
    """Every sample of `name` in /metrics text, one per label set, in the order listed."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]


def metric_total(text: str, name: str) -> float:
    """A Prometheus sample from /metrics text, summed over its label sets (0 when absent)."""
    return sum(metric_by_label(text, name, None).values())


def metric_by_label(text: str, name: str, label: str | None) -> dict[str, float]:
    """A Prometheus sample from /metrics text, summed per value of one label (None: one "" key)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        key = ""
        if label is not None:
            m = re.search(rf'[{{,]{label}="([^"]*)"', line)
            key = m.group(1) if m else ""
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out

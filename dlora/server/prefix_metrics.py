"""/metrics for prefix-cache locality: per replica and adapter, the prompt tokens sent and those the
replica found in its prefix cache (vLLM's num_cached_tokens of each leg), and the dispatches that
went elsewhere than they would have blind to the prefix caches. Read from the router at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily


class PrefixCacheCollector:
    def __init__(self) -> None:
        self.tokens: dict[tuple[int, str], list[int]] = {}  # the router's prefix_cache, copied
        self.locality_dispatches = 0

    def update(self, prefix_cache: dict[tuple[int, str], list[int]], locality_dispatches: int) -> None:
        self.tokens = {key: list(v) for key, v in prefix_cache.items()}
        self.locality_dispatches = locality_dispatches

    def describe(self):
        return []

    def collect(self):
        labels = ["replica", "adapter"]
        prompt = CounterMetricFamily(
            "dlora_prefix_cache_prompt_tokens",
            'Prompt tokens sent to a replica, per adapter ("": the base model)',
            labels=labels,
        )
        hits = CounterMetricFamily(
            "dlora_prefix_cache_hit_tokens",
            "Of those, the tokens the replica found in its prefix cache (not computed again)",
            labels=labels,
        )
        for (rid, adapter), (sent, cached) in sorted(self.tokens.items()):
            prompt.add_metric([str(rid), adapter], sent)
            hits.add_metric([str(rid), adapter], cached)
        locality = CounterMetricFamily(
            "dlora_dispatch_locality",
            "Requests dispatched to another replica than they would have been without pricing the prefill its "
            "prefix cache saves (cluster.prefix_aware_dispatch)",
        )
        locality.add_metric([], self.locality_dispatches)
        yield from (prompt, hits, locality)

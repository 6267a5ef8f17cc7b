"""The replica model with prefix caches, for prefix-aware dispatch (`cluster/prefix_locality.py`).

Each request carries its prompt's token ids. A replica's engine keeps the prompt blocks it computed,
the least recently used going beyond its KV capacity (`ReplicaModel.kv_blocks`), and a request it
admits prefills only what that cache lacks (its prompt from the first uncached block on, at least
its last token, as vLLM does). Dispatch is the server's: `today` is `ProactiveDispatch` blind to the
caches, `prefix` the same told each replica's cached prefix by the router's record (kept as requests
are sent and as they finish, exactly as `ReplicaChooser` keeps it), and `round_robin` cycles over
the replicas. The model runs no merges, so every block is in the base weight state.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from dlora.cluster.prefix_locality import PrefixLocality, prompt_blocks
from dlora.sim.model_io import ReplicaModel, TraceRequest
from dlora.sim.replica_model import ModelledCluster, SimReplica

DISPATCH = ("today", "prefix", "round_robin")


class PrefixCluster(ModelledCluster):
    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        prompts: Sequence[tuple[int, ...]],
        replicas: int,
        model: ReplicaModel,
        dispatch: str = "prefix",
        start_slack_s: float | None = None,
    ) -> None:
        """`prompts[i]`: request i's prompt token ids (`jobs[i].prompt_len` of them);
        `start_slack_s`: proactive dispatch's (`cluster.dispatch_start_slack_s`; None: pending time alone)."""
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch {dispatch!r}: must be one of {', '.join(DISPATCH)}")
        self.start_slack_s = start_slack_s
        super().__init__(jobs, replicas, model)
        self.dispatch = dispatch
        self.blocks = [prompt_blocks(p, j.adapter, "", model.block_tokens) for p, j in zip(prompts, self.jobs)]
        self.capacity = (model.kv_blocks or 1 << 20) * model.block_tokens
        self.engines = PrefixLocality()  # what each replica's cache holds
        self.record = PrefixLocality()  # what the router believes it holds
        self.turn = itertools.count()
        self.prompt_tokens = self.hit_tokens = 0
        self.locality_dispatches = 0

    def choose(self, t: float, i: int) -> int:
        live = self.serving()
        if self.dispatch == "round_robin":
            return live[next(self.turn) % len(live)].rid
        views, running = [self.view(r) for r in live], [r.running for r in live]
        blind = self.model_views.load(i, running=False)
        if self.dispatch == "today":
            return self.arrival.choose(t, views, running, blind, self.first_token)
        cached = tuple((r.rid, n) for r in live if (n := self.record.cached_tokens(r.rid, self.blocks[i], "")) > 0)
        rid = self.arrival.choose(t, views, running, dataclasses.replace(blind, cached_prefix=cached), self.first_token)
        if cached and self.arrival.choose(t, views, running, blind, self.first_token) != rid:
            self.locality_dispatches += 1
        return rid

    def place(self, t: float, i: int) -> int:
        rid = super().place(t, i)
        if self.dispatch == "prefix":
            self.record.record(rid, self.blocks[i], "", self.capacity)
        return rid

    def prefill_tokens(self, r: SimReplica, i: int) -> int:
        """A request's first admission reuses its replica's cached prompt prefix; one preempted or
        moved after it generated recomputes everything (its blocks of output are not modelled)."""
        if self.generated[i]:
            return super().prefill_tokens(r, i)
        blocks = self.blocks[i]
        cached = self.engines.cached_tokens(r.rid, blocks, "")
        self.engines.record(r.rid, blocks, "", self.capacity)
        self.prompt_tokens += self.jobs[i].prompt_len
        self.hit_tokens += cached
        return self.jobs[i].prompt_len - cached

    def end_step(self, t: float, r: SimReplica) -> None:
        done = [i for i in r.running if self.generated[i] + 1 >= self.jobs[i].output_len]
        super().end_step(t, r)
        for i in done:  # its blocks are the most recently used there now, in both views
            self.engines.record(r.rid, self.blocks[i], "", self.capacity)
            if self.dispatch == "prefix":
                self.record.record(r.rid, self.blocks[i], "", self.capacity)

    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

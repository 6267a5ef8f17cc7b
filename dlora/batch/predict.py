"""Sample-then-simulate (SamuLLM): how long a set of requests takes on the cluster.

Output lengths are not known in advance and latency is not linear in them, so one plugs in no
average: each request's output length is drawn from its adapter's recent output lengths (the
pooled lengths of all adapters while it has fewer than `min_samples` of its own; its `max_tokens`
while nothing has finished anywhere), capped by its `max_tokens`. Requests go to replicas as
dispatch sends them (the replica with the least outstanding work), and each replica's continuous
batching is simulated with its fitted step-cost model (dlora/cluster/estimators/cost_model.py):

    step time = per_iteration_s + per_decode_token_s * running + per_prefill_token_s * prefill tokens

Requests are admitted first come first served while fewer than `max_batch` run; a request runs
one step per output token (its first step also prefills its prompt). A step whose requests all
use one adapter runs merged, at `merged_ratio` of the cost. Between two finishes every step is
the same, so the simulation jumps from finish to finish: O(n log n) for n requests.
Not modelled: KV-cache limits (preemption), chunked prefill, the cost of a merge switch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.estimators.replica_sim import simulate_replica


@dataclass(frozen=True)
class RequestWork:
    """One request as the simulation sees it."""

    adapter: str | None
    prompt_tokens: int
    max_tokens: int
    # the request runs to max_tokens (`ignore_eos` without stop strings): its length is known, not drawn
    exact: bool = False


@dataclass(frozen=True)
class Prediction:
    makespan_s: float
    finish_s: tuple[float, ...]  # each request's predicted finish, in input order
    replica_of: tuple[int, ...]  # the replica each request was sent to (an index into the params)

    def eta_s(self, finished: int) -> float:
        """Predicted time left once `finished` requests are done: the makespan less the time by
        which the plan had that many done."""
        if finished <= 0:
            return self.makespan_s
        done_by = sorted(self.finish_s)[min(finished, len(self.finish_s)) - 1]
        return max(0.0, self.makespan_s - done_by)


def sample_lengths(
    works: Sequence[RequestWork], lengths_of: Callable[[str | None], Sequence[int]], rng: random.Random
) -> list[int]:
    """One draw per request from its adapter's observed lengths (`lengths_of`), capped by its
    max_tokens; max_tokens when nothing was observed or the length is exact. At least 1."""
    drawn = []
    cache: dict[str | None, Sequence[int]] = {}
    for w in works:
        if w.adapter not in cache:
            cache[w.adapter] = lengths_of(w.adapter)
        seen = cache[w.adapter]
        n = seen[rng.randrange(len(seen))] if seen and not w.exact else w.max_tokens
        drawn.append(max(1, min(n, w.max_tokens)))
    return drawn


def dispatch(
    works: Sequence[RequestWork],
    outputs: Sequence[int],
    params: Sequence[CostParams],
    held_s: Sequence[float] | None = None,
) -> list[int]:
    """The replica each request goes to: the one with the least work sent so far (starting from
    `held_s`, the seconds of work each holds already), counted as the router's dispatch counts it
    (prefill plus output at a full batch's per-token cost)."""
    load = list(held_s) if held_s is not None else [0.0] * len(params)
    chosen = []
    for w, n in zip(works, outputs):
        r = min(range(len(params)), key=lambda j: (load[j], j))
        p = params[r]
        per_token = p.per_decode_token_s + p.per_iteration_s / p.max_batch
        load[r] += w.prompt_tokens * p.per_prefill_token_s + n * per_token
        chosen.append(r)
    return chosen


def predict(
    works: Sequence[RequestWork],
    params: Sequence[CostParams],
    lengths_of: Callable[[str | None], Sequence[int]],
    seed: int = 0,
) -> Prediction:
    """The predicted makespan of `works` sent at once to replicas priced by `params`."""
    if not params:
        raise ValueError("no replica to simulate")
    outputs = sample_lengths(works, lengths_of, random.Random(seed))
    replica_of = dispatch(works, outputs, params)
    finish = [0.0] * len(works)
    for r, p in enumerate(params):
        mine = [i for i, j in enumerate(replica_of) if j == r]
        times = simulate_replica(
            [works[i].prompt_tokens for i in mine], [outputs[i] for i in mine], p, [works[i].adapter for i in mine]
        )
        for i, f in zip(mine, times):
            finish[i] = f
    return Prediction(max(finish, default=0.0), tuple(finish), tuple(replica_of))


def works_of(
    url: str, body: dict, count_tokens: Callable[[str], int], base_model: str, max_model_len: int
) -> list[RequestWork]:
    """The engine requests one batch line makes (its prompts x n), with prompt sizes counted from
    the text (a chat's template adds a few tokens per message, counted as 4). The line is one its
    route admits (dlora/batch/admit.py): n and the prompts are within the fan-out cap."""
    if url == "/v1/completions":
        prompt = body.get("prompt", "")
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        sizes = [count_tokens(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 1 for p in prompts]
    else:
        messages = body.get("messages") or []
        sizes = [sum(4 + count_tokens(_text(m)) for m in messages if isinstance(m, dict))]
    n = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
    cap = body.get("max_tokens") or body.get("max_completion_tokens")
    adapter = None if body.get("model") == base_model else str(body.get("model"))
    exact = body.get("ignore_eos") is True and not body.get("stop")
    works = []
    for size in sizes:
        room = max_model_len - size
        limit = max(1, min(cap, room) if isinstance(cap, int) else room)
        works += [RequestWork(adapter, size, limit, exact)] * max(1, n)
    return works


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # vLLM's request model leaves parts to the renderer: a part's text may not be text yet (the
        # line then fails when it runs, with its route's error)
        texts = (part.get("text") for part in content if isinstance(part, dict))
        return "".join(t for t in texts if isinstance(t, str))
    return ""

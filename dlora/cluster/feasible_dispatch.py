"""Aladdin's SLO-feasible dispatch (§4.2, constraints (b)-(e) and Algorithm 1) over dLoRA replicas.

Why: least pending time (dLoRA §5.1, `dlora.cluster.dispatch`) balances work but cannot tell
whether a replica will still meet its requests' SLOs once the new one joins: a replica with little
pending work can have a batch whose decode steps already run at the TPOT target, or requests whose
KV will outgrow the cache before they finish. Aladdin admits a request to a worker only if four
constraints still hold there afterwards; each is one function below, returning a `Check`
(`lhs <= rhs`, with both sides kept so a decision can be explained):

(b) `decode_bound`: a decode step of the whole batch stays within the tightest TPOT target on
    the replica. Aladdin's step model (Eq. 3) is t_d = (k2 * l_ave + c2) * n + c3; with the
    replica's `CostParams` (c3 = per_iteration_s, c2 = per_decode_token_s) and an optional
    per-context-token coefficient k2 (`SloReplica.per_context_token_s`, 0 in `CostParams`):
        per_iteration_s + per_decode_token_s * n + k2 * W / theta  <=  min TPOT target,
        W = sum over the n requests of (prompt + gamma * predicted output)
    which is Aladdin's sum(l_in + gamma * l_out) <= theta * l_d(n) (Eq. 4) multiplied out.
    gamma = 0.5 in Aladdin: the decode step at the middle of each request's output must meet the
    target. The predicted output counts here, where Aladdin's notation table has the tokens
    generated so far: its gamma ("gamma = 1: the last token meets the target") only means something
    with the final length, and a new request has generated nothing. With k2 = 0, theta has no
    effect here: the step time then does not depend on lengths, so length prediction errors
    cannot break this bound.
(c) `ttft_bound`: the prefill of every request not yet started (the replica's queued ones plus
    the new one, one prefill batch, Eq. 2: per_iteration_s + per_prefill_token_s * tokens) ends
    before each one's TTFT deadline (arrival + its TTFT target). Queued requests already past their
    deadline are left out: no dispatch can save them. The new request also waits for its adapter
    to load where it is absent and for a LoRA batch slot where all are taken (the same prices as
    `dlora.cluster.dispatch`).
(d) `prefill_slack`: new prefills preempt the running decodes, so their time may use at most theta
    times the TPOT slack each decoding request has banked, tpot_target * l_out - t_dec (Aladdin's
    constraint (d): l_out = tokens generated so far, t_dec = seconds spent decoding so far).
(e) `kv_peak`: the replica's KV demand, at every future decode step, stays within its capacity.
    Each request holds its context and one more token per step until its predicted output is
    complete (Aladdin's footprint vector w_j, here in tokens on `ReplicaView.kv_capacity_tokens`);
    the demand rises between two finishes and drops at each, so its peak is at one of the
    predicted finishes.

The chooser (`choose`) has two modes: `slo_feasible` takes the least pending time (dLoRA's
estimate, `dlora.cluster.dispatch.estimate`) among replicas where all four hold; `best_fit`
takes the feasible replica with the least slack (Aladdin's best-fit bin packing: fill the
fullest replica that still fits, so the others stay idle for bursts or can be released). Slack is
the smallest normalized headroom, (rhs - lhs) / rhs, over the four checks: one measure across
constraints of different units (the paper's capacity_norm mixes batch size and tokens). When no
replica is feasible the request goes to the least pending time, flagged `feasible=False`.

Inputs reuse the router's types: `ReplicaView` with its per-request `RequestLoad`s (prompt,
tokens generated, expected output from the output-length estimator, queued or running), KV
capacity in tokens, and the replica's fitted `CostParams`. `SloReplica` adds only what those
lack: each decoding request's seconds spent decoding (for (d)) and the optional k2. A view built
for fast dispatch (`ReplicaView.totals`, no per-request list) cannot be checked: (d) and (e) need
each request. Aladdin's assumptions kept: a prefill batch runs alone and preempts decodes (vLLM's
default without chunked prefill), and every request placed on a replica joins its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dlora.cluster.dispatch import NoEligibleReplica, estimate
from dlora.cluster.estimators.replica_cost import batch_slot_wait, load_time
from dlora.cluster.policy_views import ReplicaView, RequestLoad
from dlora.cost.params import CostParams
from dlora.slo.config import AdapterSlo

MODES = ("slo_feasible", "best_fit")
REL_TOL = 1e-9  # a side equal to the other up to float rounding holds

SloOf = Callable[[RequestLoad], AdapterSlo]  # the SLO a request is held to (its adapter's, or the default)


@dataclass(frozen=True, slots=True)
class SloReplica:
    """One replica as the SLO checks see it: the router's view and cost model, plus what they lack."""

    view: ReplicaView  # with `requests` filled in (not `totals`)
    params: CostParams = field(default_factory=CostParams)
    # request_id -> seconds the running request has spent decoding (since its first token);
    # a missing decoding request is taken as exactly on target: tpot * (generated - 1).
    decode_elapsed_s: Mapping[str, float] = field(default_factory=dict)
    # Aladdin's k2 (Eq. 3): decode-step seconds per token of context in the batch; 0 = CostParams' model.
    per_context_token_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Check:
    """One constraint: it holds when lhs <= rhs."""

    name: str
    lhs: float
    rhs: float

    @property
    def ok(self) -> bool:
        return self.lhs <= self.rhs + REL_TOL * max(1.0, abs(self.rhs))

    @property
    def headroom(self) -> float:
        """(rhs - lhs) / rhs: the share of the limit left (1 with no limit, negative when broken)."""
        if math.isinf(self.rhs) and self.rhs > 0:
            return 1.0
        if self.rhs > 0:
            return (self.rhs - self.lhs) / self.rhs
        return 0.0 if self.ok else -math.inf


@dataclass(frozen=True, slots=True)
class Feasibility:
    replica_id: int
    checks: tuple[Check, ...]

    @property
    def feasible(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def slack(self) -> float:
        """The smallest headroom over the checks (what best fit minimizes)."""
        return min((c.headroom for c in self.checks), default=1.0)


@dataclass(frozen=True, slots=True)
class SloDispatchDecision:
    replica_id: int
    load_adapter: bool  # the adapter is absent there: load it before the request may run
    pending_s: float  # dLoRA's estimated pending time on that replica, own work included
    feasible: bool  # False: no replica met every constraint, so the least pending time was taken
    slack: float  # the chosen replica's smallest headroom (negative when infeasible)
    checks: tuple[Check, ...] = ()


def _requests(view: ReplicaView) -> tuple[RequestLoad, ...]:
    if view.totals is not None and not view.requests:
        raise ValueError(f"replica {view.replica_id}: the SLO checks need per-request views, not totals")
    return view.requests


def _predicted_output(r: RequestLoad) -> float:
    """Total output the request is expected to generate (never less than it has)."""
    return max(r.expected_output_tokens, float(r.output_tokens))


def prefill_seconds(params: CostParams, tokens: float) -> float:
    """Aladdin Eq. 2 with the replica's coefficients: one prefill batch of `tokens` tokens."""
    return params.per_iteration_s + params.per_prefill_token_s * tokens


def _new_prefill_tokens(view: ReplicaView, req: RequestLoad) -> tuple[list[RequestLoad], int]:
    """The requests not started yet (queued + the new one) and the tokens their prefill computes
    (a moved request also re-prefills what it generated elsewhere; the new one skips the prefix
    the replica's cache probably holds)."""
    pending = [r for r in _requests(view) if not r.running] + [req]
    return pending, sum(r.context_tokens for r in pending) - req.cached_on(view.replica_id)


def decode_bound(replica: SloReplica, req: RequestLoad, slo_of: SloOf, gamma: float, theta: float) -> Check:
    """Constraint (b): the decode step of all n requests, the new one included, within the
    tightest TPOT target among them (Aladdin Eqs. 3-4)."""
    batch = (*_requests(replica.view), req)
    p = replica.params
    weighted = sum(r.prompt_tokens + gamma * _predicted_output(r) for r in batch)
    step = p.per_iteration_s + p.per_decode_token_s * len(batch) + replica.per_context_token_s * weighted / theta
    return Check("decode_bound", step, min(slo_of(r).tpot_s for r in batch))


def ttft_bound(replica: SloReplica, req: RequestLoad, slo_of: SloOf, now: float) -> Check:
    """Constraint (c): every request not started yet gets its first token by its TTFT deadline,
    with the prefill batch of all of them starting now (the new request after its adapter load
    and batch-slot wait). Reports the binding request's sides: now-relative finish and deadline."""
    view, p = replica.view, replica.params
    pending, tokens = _new_prefill_tokens(view, req)
    prefill = prefill_seconds(p, tokens)
    binding: Check | None = None
    for r in pending:
        left = r.arrival + slo_of(r).ttft_s - now
        if r is not req and left < 0:
            continue  # already missed: nothing placed here can make it worse
        wait = (load_time(p, view, req.adapter) + batch_slot_wait(p, view, req.adapter)) if r is req else 0.0
        check = Check("ttft_bound", wait + prefill, left)
        if binding is None or check.rhs - check.lhs < binding.rhs - binding.lhs:
            binding = check
    assert binding is not None  # `req` itself is never skipped
    return binding


def prefill_slack(replica: SloReplica, req: RequestLoad, slo_of: SloOf, theta: float) -> Check:
    """Constraint (d): the new prefills take at most theta x the least TPOT slack banked by the
    decoding requests, slack = tpot_target * generated - seconds decoding so far."""
    view, p = replica.view, replica.params
    _, tokens = _new_prefill_tokens(view, req)
    slacks = []
    for r in _requests(view):
        if not r.running or r.output_tokens < 1:
            continue  # not decoding yet: its first token is the TTFT check's concern
        target = slo_of(r).tpot_s
        elapsed = replica.decode_elapsed_s.get(r.request_id, target * (r.output_tokens - 1))
        slacks.append(target * r.output_tokens - elapsed)
    return Check("prefill_slack", prefill_seconds(p, tokens), theta * min(slacks, default=math.inf))


def kv_peak_tokens(footprints: Sequence[tuple[float, float]]) -> float:
    """The most KV tokens held at once by requests given as (context now, output tokens still to
    come): at step k each holds context + k while k <= its remaining output, nothing after.
    Between two finishes the demand only grows, so the peak is at k = 0 or at a finish."""
    items = sorted(((max(0.0, left), c) for c, left in footprints), reverse=True)
    peak = context = 0.0
    for i, (k, c) in enumerate(items):
        context += c
        if i + 1 == len(items) or items[i + 1][0] < k:  # every request with left >= k counted
            peak = max(peak, context + (i + 1) * k)
    return max(peak, context)  # k = 0: every request holds its context


def kv_peak(replica: SloReplica, req: RequestLoad, kv_limit: float = 1.0) -> Check:
    """Constraint (e): the KV peak over future steps, the new request included, within
    `kv_limit` x the replica's KV capacity in tokens."""
    batch = (*_requests(replica.view), req)
    peak = kv_peak_tokens([(float(r.context_tokens), r.remaining_output_tokens) for r in batch])
    return Check("kv_peak", peak, kv_limit * replica.view.kv_capacity_tokens)


def feasibility(
    replica: SloReplica,
    req: RequestLoad,
    slo_of: SloOf,
    now: float,
    gamma: float = 0.5,
    theta: float = 0.9,
    kv_limit: float = 1.0,
) -> Feasibility:
    """All four constraints for `req` on `replica` (gamma in [0, 1], theta in (0, 1], as in `SloConfig`)."""
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma={gamma!r}: must be in [0, 1]")
    if not 0 < theta <= 1:
        raise ValueError(f"theta={theta!r}: must be in (0, 1]")
    return Feasibility(
        replica.view.replica_id,
        (
            decode_bound(replica, req, slo_of, gamma, theta),
            ttft_bound(replica, req, slo_of, now),
            prefill_slack(replica, req, slo_of, theta),
            kv_peak(replica, req, kv_limit),
        ),
    )


def choose(
    replicas: Sequence[SloReplica],
    req: RequestLoad,
    slo_of: SloOf,
    now: float,
    mode: str = "slo_feasible",
    gamma: float = 0.5,
    theta: float = 0.9,
    kv_limit: float = 1.0,
) -> SloDispatchDecision:
    """The replica for `req`: least pending time (`slo_feasible`) or least slack (`best_fit`)
    among the replicas that can take it and meet every constraint; the least pending time, flagged
    infeasible, when none does. Ties go to the lower pending time, then the lower replica id.
    Raises NoEligibleReplica when no healthy replica holds the adapter or has a slot for it."""
    if mode not in MODES:
        raise ValueError(f"SLO dispatch mode {mode!r}: must be one of {', '.join(MODES)}")
    eligible = [r for r in replicas if r.view.can_take(req.adapter)]
    if not eligible:
        raise NoEligibleReplica(f"no healthy replica holds {req.adapter!r} or has a free adapter slot")
    scored = [
        (feasibility(r, req, slo_of, now, gamma, theta, kv_limit), estimate(r.view, req, r.params), r) for r in eligible
    ]
    feasible = [s for s in scored if s[0].feasible]
    if feasible and mode == "best_fit":
        fit, pending, rep = min(feasible, key=lambda s: (s[0].slack, s[1], s[2].view.replica_id))
    else:
        fit, pending, rep = min(feasible or scored, key=lambda s: (s[1], s[2].view.replica_id))
    return SloDispatchDecision(
        replica_id=rep.view.replica_id,
        load_adapter=not rep.view.holds(req.adapter),
        pending_s=pending,
        feasible=fit.feasible,
        slack=fit.slack,
        checks=fit.checks,
    )

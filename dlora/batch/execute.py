"""How one batch line runs in this server: through the same handlers as the online routes.

A line is held to its route's rules as the file is read (`line_rules`: the body-size cap, the
values and client priority dlora admits, the fan-out of prompts x n, vLLM's request model), so the
planner sees only lines the route would take. It is answered by the same code that builds the
route's non-streamed response, at the batch's engine priority. Whatever fails is that line's
error, shaped as the route would have answered it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

from pydantic import ValidationError

from dlora.adapters.registry import AdapterNotFoundError
from dlora.batch.admit import route_refusal
from dlora.batch.files import FileStore
from dlora.batch.gate import BatchGate
from dlora.batch.held_jobs import held_jobs
from dlora.batch.lines import BatchLine, LineError, error_output, line_request_id, ok_output
from dlora.batch.planned import LinePlan, line_plan
from dlora.batch.predict import RequestWork, works_of
from dlora.batch.prompt_sizes import PromptSizes
from dlora.batch.reading import LineRules
from dlora.batch.service import BatchService
from dlora.batch.store import BatchStore
from dlora.cluster.estimators.held_work import planning_lengths
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.config import ServerConfig
from dlora.scheduling.config import einsum_merged_cost
from dlora.server.errors import APIError, as_api_error, error_body
from dlora.slo.isolated import mean_params

log = logging.getLogger(__name__)

# A line the cluster cannot take now (503: no replica up, no room for its adapter) is tried again
# after these waits, doubling: a batch has hours, where an online client is told to retry.
UNAVAILABLE_RETRY_FIRST_S = 1.0
UNAVAILABLE_RETRY_MAX_S = 15.0


async def execute_line(state, line: BatchLine, priority: int) -> dict:
    """The line's output line (a success or its error). While the cluster answers 503 and a replica
    may still come back, the line waits and runs again; the batch's cancel or expiry ends the wait."""
    rid = line_request_id()
    wait_s = UNAVAILABLE_RETRY_FIRST_S
    while True:
        try:
            return ok_output(line.custom_id, rid, await _answer(state, line, rid, priority))
        except ValidationError as e:
            err = serving_error(e, rid)
        except Exception as e:
            err = as_api_error(e, rid)
        if err.status != 503 or not state.router.may_serve_soon():
            break
        await asyncio.sleep(wait_s)
        wait_s = min(2 * wait_s, UNAVAILABLE_RETRY_MAX_S)
    body = error_body(err.status, err.message, err.param)
    failure = LineError(line.line, line.custom_id, body["error"]["type"], err.message, err.status, body)
    return error_output(failure, rid)


def serving_error(exc: ValidationError, rid: str) -> APIError:
    """The body passed its request model as the file was read, so this was raised within vLLM's
    serving (rendering a message's parts): the answer vLLM's server gives, as to any ValueError.
    (Imported here: the frontend's module imports the server's state, which imports the batches.)"""
    from dlora.server.vllm_frontend import error_of

    error = error_of(exc, rid).error
    return APIError(error.code, error.message, error.param)


async def _answer(state, line: BatchLine, rid: str, priority: int) -> dict:
    # The line met its route's admission as the file was read (`line_rules`); the client's priority
    # was checked there, and is replaced here.
    return await state.frontend.answer(line.url, line.body, rid, priority)


def line_rules(server: ServerConfig) -> LineRules:
    """What every line of a batch meets before it is planned: what its route admits."""
    return LineRules(server.max_body_bytes, lambda line: route_refusal(line, server))


def online_in_flight(router, batch_priority: int) -> int:
    """Requests in the cluster that are not batch work."""
    return router.table.below_priority(batch_priority)


def batch_gate(state, beside_online: bool = True) -> BatchGate:
    """As many batch lines at once as the engines hold (batch.max_in_flight, else max_num_seqs per
    serving replica), less the online requests in flight. `beside_online`: the lines' completions
    also count against server.max_pending_requests beside the online ones admitted, batch work
    holding at most half of it; off (`dlora batch run`, which takes no online requests), they are
    bounded by the lines' places alone."""
    cfg = state.cfg

    def limit() -> int:
        return cfg.batch.max_in_flight or cfg.engine.max_num_seqs * max(1, len(state.router.serving_ids()))

    def online() -> int:
        return online_in_flight(state.router, cfg.batch.priority)

    if not beside_online:
        return BatchGate(limit, online)
    gate = BatchGate(limit, online, lambda: cfg.server.max_pending_requests, lambda: state.admitted.count)
    state.metrics.batch_choices_in_flight.set_function(lambda: gate.choices_in_flight)
    return gate


def line_works(state, lines: Sequence[BatchLine]) -> list[list[RequestWork]]:
    """The engine requests each line makes, with prompt sizes from the server's tokenizer (a
    sample counted exactly, the rest estimated: dlora/batch/prompt_sizes.py)."""
    tokenizer, cfg = state.tokenizer, state.cfg

    def tokenize(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    count = PromptSizes(tokenize).count
    return [works_of(line.url, line.body, count, state.base_model_name, cfg.model.max_model_len) for line in lines]


def plan_params(router, merged_prior: float | None = None) -> dict[int, CostParams]:
    """Every serving replica priced alike, by the mean of their fitted costs: they are one kind of
    hardware, and a fit from a few small steps must not make one replica look free (a plan would
    send it every line). `merged_prior` replaces the merged/unmerged ratio of each replica that
    has not measured it (`ReplicaCostModel.params_with_ratio`)."""
    models = router.cost_models
    serving = [rid for rid in router.serving_ids() if rid in models]
    costs = [
        models[rid].params if merged_prior is None else models[rid].params_with_ratio(merged_prior) for rid in serving
    ]
    shared = mean_params(costs)
    return {rid: shared for rid in serving}


def merge_prior(state, works: Sequence[Sequence[RequestWork]]) -> float | None:
    """The prior merged/unmerged step cost for these requests' adapters with the einsum kernels
    (`einsum_merged_cost` of their mean LoRA fraction, base-model requests counting 0); None with
    another backend, with `scheduling.merged_cost_ratio` set, or with no adapter in the batch."""
    cfg = state.cfg
    if cfg.engine.lora_backend != "einsum" or cfg.scheduling.merged_cost_ratio is not None:
        return None
    fractions: dict[str, float] = {}
    per_request = []
    for w in (w for ws in works for w in ws):
        if w.adapter is not None and w.adapter not in fractions:
            try:
                rec = state.adapters.registry.get(w.adapter)
            except AdapterNotFoundError:
                rec = None  # not registered: the line fails with its own error, and costs nothing
            fractions[w.adapter] = state.adapters.base.lora_fraction(rec.rank, rec.target_modules) if rec else 0.0
        per_request.append(0.0 if w.adapter is None else fractions[w.adapter])
    if not fractions:
        return None
    return einsum_merged_cost(sum(per_request) / len(per_request))


class ServerPlanner:
    """`batch.planner: stages` over this server's router: its replicas' fitted step costs and its
    adapters' output-length histories. `known_works` (line number -> its engine requests) spares
    tokenizing lines a caller has already counted."""

    def __init__(self, state, known_works: dict[int, list[RequestWork]] | None = None) -> None:
        self.state = state
        self.known_works = known_works or {}

    def _works(self, lines: Sequence[BatchLine]) -> list[list[RequestWork]]:
        new = [line for line in lines if line.line not in self.known_works]
        self.known_works.update(zip((line.line for line in new), line_works(self.state, new)))
        return [self.known_works[line.line] for line in lines]

    def costs_measured(self) -> bool:
        router = self.state.router
        serving = [router.cost_models.get(rid) for rid in router.serving_ids()]
        return bool(serving) and all(m is not None and m.measured for m in serving)

    async def plan(self, lines: Sequence[BatchLine]) -> LinePlan | None:
        router = self.state.router
        if not lines:
            return None
        measured = self.costs_measured()
        works = await asyncio.to_thread(self._works, lines)
        # The backend's one prior is for small adapters; a merged step saves far more with large ones.
        params = plan_params(router, merge_prior(self.state, works))
        if not params:
            return None
        # Read on the event loop (requests finish and lengths are recorded there); the planner's
        # thread gets copies.
        router.recount()  # the dispatch totals as of now, as the balancer reads them before its views
        held = {v.replica_id: v.requests for v in router.views() if v.replica_id in params}
        adapters = {w.adapter for ws in works for w in ws} | {r.adapter for reqs in held.values() for r in reqs}
        history = router.output_lengths.history(adapters)
        plan = await asyncio.to_thread(self._plan, lines, works, params, held, history)
        plan = dataclasses.replace(plan, measured_costs=measured)
        p = next(iter(params.values()))
        log.info(
            "batch plan for %d lines on %d replicas (step costs %s: %.1f ms a step + %.2f ms a decoded"
            " token + %.3f ms a prompt token, merged x%.2f): %s, %d segments, predicted %.0f s",
            len(lines),
            len(params),
            "measured" if measured else "from priors",
            p.per_iteration_s * 1e3,
            p.per_decode_token_s * 1e3,
            p.per_prefill_token_s * 1e3,
            p.merged_ratio,
            plan.mode,
            plan.segments,
            plan.predicted_s,
        )
        return plan

    def _plan(self, lines, works, params, held, history) -> LinePlan:
        """The plan over what each replica holds already (lines of a plan made earlier, online
        requests), lengths from the finished requests and the running ones."""
        running = [r for reqs in held.values() for r in reqs if r.running]
        lengths = planning_lengths(history, running)
        holds = {rid: held_jobs(reqs, lambda a: lengths.get(a, ())) for rid, reqs in held.items()}
        per_replica = self.state.cfg.engine.max_num_seqs
        gain = self.state.cfg.batch.min_stage_gain
        return line_plan(
            lines, works, params, lambda a: lengths.get(a, ()), per_replica, held=holds, min_stage_gain=gain
        )


def batch_planner(state, known_works: dict[int, list[RequestWork]] | None = None) -> ServerPlanner | None:
    """The configured planner (`batch.planner`); None sends a batch's lines as they come."""
    return ServerPlanner(state, known_works) if state.cfg.batch.planner == "stages" else None


def server_batches(state) -> BatchService:
    """The server's batch service: files and batches under its state directory, lines run at the
    configured batch priority through `batch_gate`."""
    cfg = state.cfg
    service = BatchService(
        cfg.batch,
        FileStore(cfg.state_dir / "files"),
        BatchStore(cfg.state_dir / "batches"),
        lambda line: execute_line(state, line, cfg.batch.priority),
        batch_gate(state),
        batch_planner(state),
        line_rules(cfg.server),
    )
    service.on_line = lambda outcome: state.metrics.batch_requests.labels(outcome).inc()
    return service

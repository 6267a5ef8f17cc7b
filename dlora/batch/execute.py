"""How one batch line runs in this server: through the same handlers as the online routes.

A line is validated as its route's request body, checked against the same limits (the fan-out
of prompts x n, the client-priority policy), and answered by the same code that builds the
route's non-streamed response, at the batch's engine priority. Whatever fails is that line's
error, shaped as the route would have answered it.
"""

from __future__ import annotations

import uuid

from pydantic import ValidationError

from dlora.batch.files import FileStore
from dlora.batch.gate import BatchGate
from dlora.batch.lines import BatchLine, LineError, error_output, ok_output
from dlora.batch.service import BatchService
from dlora.batch.store import BatchStore
from dlora.server.admission import fanout_of_data
from dlora.server.errors import APIError, as_api_error, error_body, invalid_body
from dlora.server.protocol import ChatCompletionRequest, CompletionRequest
from dlora.server.routes_openai import chat_completion_body, completion_body


async def execute_line(state, line: BatchLine, priority: int) -> dict:
    """The line's output line (a success or its error)."""
    rid = f"batch_req-{uuid.uuid4().hex}"
    try:
        return ok_output(line.custom_id, rid, await _answer(state, line, rid, priority))
    except ValidationError as e:
        err = invalid_body(e)
    except Exception as e:
        err = as_api_error(e, rid)
    body = error_body(err.status, err.message, err.param)
    failure = LineError(line.line, line.custom_id, body["error"]["type"], err.message, err.status)
    return error_output(failure, rid, body)


async def _answer(state, line: BatchLine, rid: str, priority: int) -> dict:
    too_wide = fanout_of_data(line.url, line.body).too_wide(state.cfg.server.max_choices_per_request)
    if too_wide is not None:
        raise APIError(400, *too_wide)
    if line.url == "/v1/completions":
        return await completion_body(state, CompletionRequest.model_validate(line.body), rid, priority)
    return await chat_completion_body(state, ChatCompletionRequest.model_validate(line.body), rid, priority)


def online_in_flight(router, batch_priority: int) -> int:
    """Requests in the cluster that are not batch work."""
    return sum(1 for st in router.requests.values() if st.request.priority < batch_priority)


def batch_gate(state) -> BatchGate:
    """As many batch lines at once as the engines hold (batch.max_in_flight, else max_num_seqs per
    serving replica), less the online requests in flight."""
    cfg = state.cfg

    def limit() -> int:
        return cfg.batch.max_in_flight or cfg.engine.max_num_seqs * max(1, len(state.router.healthy_ids()))

    return BatchGate(limit, lambda: online_in_flight(state.router, cfg.batch.priority))


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
    )
    service.on_line = lambda outcome: state.metrics.batch_requests.labels(outcome).inc()
    return service

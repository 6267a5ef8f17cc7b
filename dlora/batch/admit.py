"""A batch line held to its route's rules before it is planned or run.

An HTTP request meets, in order: dlora's admission (dlora/server/admission.py: its values and
client priority by `check_body`, then the fan-out cap of prompts x n), then vLLM's request model
(`CompletionRequest` / `ChatCompletionRequest`). A line meets the same, in the same order (and a
fan-out past `server.max_pending_requests`, which online is a 429 however idle the server), and
is refused with the same status and error body; the body-size cap is applied as the file is read
(dlora/batch/reading.py). A refused line is that line's error and never reaches the planner,
which reads a line's prompts and `n` to predict its work.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from dlora.batch.lines import BatchLine, LineError
from dlora.batch.reading import refusal_of
from dlora.config import ServerConfig
from dlora.server.admission import fanout_of_data, overloaded
from dlora.server.errors import APIError, invalid_body
from dlora.server.validation import check_body

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def route_refusal(line: BatchLine, server: ServerConfig) -> LineError | None:
    """The error the line's route would answer before any work starts; None when it admits it."""
    try:
        check_body(line.body, None, server)
        fanout = fanout_of_data(line.url, line.body)
        too_wide = fanout.too_wide(server.max_choices_per_request)
        if too_wide is not None:
            raise APIError(400, *too_wide)
        if fanout.choices > server.max_pending_requests:  # online, this is a 429 however idle the server
            raise APIError(429, overloaded(server.max_pending_requests, fanout.choices))
        REQUEST_MODELS[line.url].model_validate(line.body)
    except APIError as e:
        return refusal_of(line.line, line.custom_id, e.status, e.message, e.param)
    except ValidationError as e:
        err = invalid_body(e)
        return refusal_of(line.line, line.custom_id, err.status, err.message, err.param)
    except Exception as e:
        # vLLM's models raise TypeError and ValueError from their own validators (`messages: 5`);
        # its server answers those 400 with their text, and anything else 500 without it. (Imported
        # here: the frontend's module imports the server's state, which imports the batches.)
        from dlora.server.vllm_frontend import error_of

        error = error_of(e, f"batch line {line.line}").error
        return refusal_of(line.line, line.custom_id, error.code, error.message, error.param)
    return None

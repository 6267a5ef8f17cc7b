"""One line of a batch input file in; one line of its output or error file out.

Input lines are OpenAI's batch requests, `{"custom_id", "method": "POST", "url", "body"}`; vLLM's
`run-batch` reads the same. Output lines are OpenAI's and vLLM's:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A line that
failed carries its HTTP status and the error body in `response` (OpenAI's error file) and
`{"code", "message"}` in `error` (what vLLM's readers look at); a line that is not a request at
all (not JSON, no custom_id) has no response, only the error, with its line number.
Everything a line can get wrong is that line's error: a batch never fails for one bad line.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class BatchLine:
    """A request line: `line` is its 1-based line number in the input file."""

    line: int
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str  # invalid_json | invalid_request | duplicate_custom_id | unsupported_url, or the HTTP error's type
    message: str
    status: int = 400


def parse_line(line: int, raw: str, endpoint: str | None) -> BatchLine | LineError:
    """Check one non-blank input line. `endpoint` is the batch's (every line must name it); None
    (`dlora batch run`, as vLLM's run-batch) takes any supported endpoint on any line."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return LineError(line, None, "invalid_json", f"line {line} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return LineError(line, None, "invalid_request", f"line {line} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        why = f"line {line}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters"
        return LineError(line, None, "invalid_request", why)
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return LineError(line, custom_id, "invalid_request", f"line {line}: method must be POST, got {method!r}")
    if endpoint is not None and url != endpoint:
        why = f"line {line}: url {url!r} is not this batch's endpoint {endpoint!r}"
        return LineError(line, custom_id, "unsupported_url", why)
    if url not in ENDPOINTS:
        why = f"line {line}: url {url!r} is not supported; use one of {', '.join(ENDPOINTS)}"
        return LineError(line, custom_id, "unsupported_url", why)
    if not isinstance(body, dict):
        return LineError(line, custom_id, "invalid_request", f"line {line}: body must be a JSON object")
    if body.get("stream"):
        return LineError(line, custom_id, "invalid_request", f"line {line}: a batch request cannot be streamed")
    return BatchLine(line, custom_id, url, body)


def parse_lines(text: str, endpoint: str | None) -> list[BatchLine | LineError]:
    """Every non-blank line, in order. A custom_id seen before makes the later line an error."""
    parsed: list[BatchLine | LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        item = parse_line(number, raw, endpoint)
        if isinstance(item, BatchLine):
            if item.custom_id in seen:
                why = f"line {number}: custom_id {item.custom_id!r} was used by an earlier line"
                item = LineError(number, item.custom_id, "duplicate_custom_id", why)
            else:
                seen.add(item.custom_id)
        parsed.append(item)
    return parsed


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def ok_output(custom_id: str, request_id: str, body: dict) -> dict:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_output(err: LineError, request_id: str | None = None, body: dict | None = None) -> dict:
    """`request_id` and `body` (the error response) when the line reached the server's handler."""
    response = None
    if request_id is not None:
        response = {"status_code": err.status, "request_id": request_id, "body": body}
    error = {"code": err.code, "message": err.message}
    if err.custom_id is None:
        error["line"] = err.line  # type: ignore[assignment]
    return {"id": _line_id(), "custom_id": err.custom_id, "response": response, "error": error}


def is_error(output: dict) -> bool:
    return output.get("error") is not None

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
from dataclasses import dataclass, field
from typing import TypeGuard

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
MAX_CUSTOM_ID = 512
SHOWN_CHARS = 64  # of a client's value quoted in an error message
# What separates lines: "\n" alone, as vLLM's run-batch splits. `str.splitlines()` would also split
# at U+2028, U+2029 and U+0085, which JSON strings may hold as they are.
NEWLINE = "\n"
BLANK = " \t\r\n"  # JSON's whitespace: a line of nothing else is skipped


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
    # The error response the line's route answered (OpenAI's shape); None for a line that is no request.
    response_body: dict | None = field(default=None, compare=False)


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
    if not _good_custom_id(custom_id):
        why = f"line {line}: custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters"
        return LineError(line, None, "invalid_request", why)
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return LineError(line, custom_id, "invalid_request", f"line {line}: method must be POST, got {_shown(method)}")
    if endpoint is not None and url != endpoint:
        why = f"line {line}: url {_shown(url)} is not this batch's endpoint {endpoint!r}"
        return LineError(line, custom_id, "unsupported_url", why)
    if url not in ENDPOINTS:
        why = f"line {line}: url {_shown(url)} is not supported; use one of {', '.join(ENDPOINTS)}"
        return LineError(line, custom_id, "unsupported_url", why)
    if not isinstance(body, dict):
        return LineError(line, custom_id, "invalid_request", f"line {line}: body must be a JSON object")
    if body.get("stream"):
        return LineError(line, custom_id, "invalid_request", f"line {line}: a batch request cannot be streamed")
    return BatchLine(line, custom_id, url, body)


def _shown(value: object) -> str:
    """A client's value quoted in a message, cut short (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _good_custom_id(custom_id: object) -> TypeGuard[str]:
    """A non-empty string of valid Unicode (it is written back in the output), not too long."""
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        return False
    try:
        custom_id.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON)
        return False
    return True


class LineParser:
    """Lines in file order: each is a request or its error; a custom_id seen before makes the
    later line an error."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint
        self.seen: set[str] = set()

    def parse(self, number: int, raw: str) -> BatchLine | LineError:
        item = parse_line(number, raw, self.endpoint)
        if isinstance(item, BatchLine):
            if item.custom_id in self.seen:
                why = f"line {number}: custom_id {item.custom_id!r} was used by an earlier line"
                return LineError(number, item.custom_id, "duplicate_custom_id", why)
            self.seen.add(item.custom_id)
        return item


def parse_lines(text: str, endpoint: str | None) -> list[BatchLine | LineError]:
    """Every non-blank line of `text`, in order (files are read as they stream: dlora/batch/reading.py)."""
    parser = LineParser(endpoint)
    return [parser.parse(number, raw) for number, raw in enumerate(text.split(NEWLINE), start=1) if raw.strip(BLANK)]


def line_request_id() -> str:
    """The request id of a line that reached its route (it names the line's engine requests)."""
    return f"batch_req-{uuid.uuid4().hex}"


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
    """`request_id` and `body` (the error response) when the line reached the server's handler;
    a line its route refused before any work (`err.response_body`) gets a request id of its own."""
    body = body if body is not None else err.response_body
    response = None
    if request_id is not None or body is not None:
        response = {"status_code": err.status, "request_id": request_id or line_request_id(), "body": body}
    error = {"code": err.code, "message": err.message}
    if err.custom_id is None:
        error["line"] = err.line  # type: ignore[assignment]
    return {"id": _line_id(), "custom_id": err.custom_id, "response": response, "error": error}


def is_error(output: dict) -> bool:
    return output.get("error") is not None

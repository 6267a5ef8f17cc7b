"""Batch input lines: every way a line can be wrong is that line's error, with its line number or
custom_id; output lines have OpenAI's and vLLM's shape."""

from __future__ import annotations

import json

import pytest

from dlora.batch.lines import BatchLine, LineError, error_output, ok_output, parse_lines

CMPL = "/v1/completions"


def line(custom_id="r1", url=CMPL, body=None, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body or {"model": "m"}})


@pytest.mark.parametrize(
    ("raw", "code", "says"),
    [
        ("{not json", "invalid_json", "line 1 is not valid JSON"),
        ("[1, 2]", "invalid_request", "line 1 is not a JSON object"),
        (json.dumps({"method": "POST", "url": CMPL, "body": {}}), "invalid_request", "custom_id must be"),
        (line(custom_id=""), "invalid_request", "custom_id must be"),
        (line(custom_id="x" * 513), "invalid_request", "custom_id must be"),
        (line(method="GET"), "invalid_request", "method must be POST, got 'GET'"),
        (line(url="/v1/chat/completions"), "unsupported_url", "is not this batch's endpoint '/v1/completions'"),
        (line(body=[1]), "invalid_request", "body must be a JSON object"),
        (line(body={"model": "m", "stream": True}), "invalid_request", "cannot be streamed"),
    ],
)
def test_a_bad_line_is_an_error_naming_why(raw, code, says):
    [err] = parse_lines(raw, CMPL)
    assert isinstance(err, LineError)
    assert (err.line, err.code, err.status) == (1, code, 400)
    assert says in err.message


def test_lines_keep_their_numbers_blank_lines_are_skipped_and_a_repeated_custom_id_is_an_error():
    text = "\n".join([line("a"), "", "   ", line("b"), line("a")]) + "\n"
    parsed = parse_lines(text, CMPL)
    assert [(p.line, p.custom_id, type(p).__name__) for p in parsed] == [
        (1, "a", "BatchLine"),
        (4, "b", "BatchLine"),
        (5, "a", "LineError"),
    ]
    assert parsed[2].code == "duplicate_custom_id"


def test_without_a_batch_endpoint_each_line_may_name_either_route_but_nothing_else():
    text = "\n".join([line("a", "/v1/completions"), line("b", "/v1/chat/completions"), line("c", "/v1/embeddings")])
    parsed = parse_lines(text, None)
    assert [type(p).__name__ for p in parsed] == ["BatchLine", "BatchLine", "LineError"]
    assert parsed[2].code == "unsupported_url"


def test_output_lines_have_openais_shape():
    ok = ok_output("a", "rid", {"x": 1})
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "rid", "body": {"x": 1}}
    # A line that reached a handler: its HTTP status and error body, and the error for vLLM's readers.
    failed = error_output(LineError(3, "b", "NotFoundError", "no such model", 404), "rid2", {"error": {"code": 404}})
    assert failed["response"] == {"status_code": 404, "request_id": "rid2", "body": {"error": {"code": 404}}}
    assert failed["error"] == {"code": "NotFoundError", "message": "no such model"}
    # A line that is no request at all: no response, its line number.
    unparsed = error_output(LineError(7, None, "invalid_json", "bad"))
    assert unparsed["response"] is None and unparsed["custom_id"] is None
    assert unparsed["error"] == {"code": "invalid_json", "message": "bad", "line": 7}
    assert isinstance(BatchLine(1, "a", CMPL, {}), BatchLine)

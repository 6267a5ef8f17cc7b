"""A batch input file read as it streams: lines split on "\\n" alone, the request cap met as the
file is read (the rest is never parsed or checked), a line past the body cap refused alone (and
skipped unread), undecodable bytes and a failing check that line's error only."""

from __future__ import annotations

import json

import pytest

from dlora.batch.lines import BatchLine, LineError, parse_lines
from dlora.batch.reading import ENVELOPE_BYTES, LineRules, TooManyRequests, read_batch_file

CMPL = "/v1/completions"


def line(custom_id: str, prompt: str = "hi", ascii_only: bool = False, **body) -> str:
    obj = {"custom_id": custom_id, "method": "POST", "url": CMPL, "body": {"model": "m", "prompt": prompt, **body}}
    return json.dumps(obj, ensure_ascii=ascii_only)


def write(tmp_path, content: bytes):
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_unicode_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path, separator):
    text = line("a", f"one{separator}two") + "\n" + line("b") + "\r\n"
    path = write(tmp_path, text.encode())
    for parsed in (read_batch_file(path, CMPL, None), parse_lines(text, CMPL)):
        assert [(p.line, p.custom_id, type(p).__name__) for p in parsed] == [
            (1, "a", "BatchLine"),
            (2, "b", "BatchLine"),
        ]
        assert parsed[0].body["prompt"] == f"one{separator}two"


def test_the_request_cap_is_met_as_the_file_is_read_and_the_rest_is_never_checked(tmp_path):
    checked = []

    def check(item: BatchLine) -> None:
        checked.append(item.line)

    path = write(tmp_path, ("\n".join(line(f"r{i}") for i in range(1000)) + "\n").encode())
    with pytest.raises(TooManyRequests, match=r"more than 5 requests \(batch.max_requests\)"):
        read_batch_file(path, CMPL, 5, LineRules(check=check))
    assert checked == [1, 2, 3, 4, 5]
    # Blank lines are not requests; junk lines are.
    assert len(read_batch_file(write(tmp_path, b"\n \n\t\r\nx\ny\n"), CMPL, 2)) == 2


def test_a_body_over_the_cap_is_that_lines_413_and_an_over_long_line_is_skipped_unread(tmp_path):
    cap = 2000
    lines = [
        line("small"),
        line("big", "x" * 2100),  # the body is over the cap, the line within the envelope
        line("huge", "y" * (cap + ENVELOPE_BYTES + 10)),  # past the envelope too: never parsed
        line("after"),
        # over the cap as written (each "é" escaped in 6 bytes), not as a client would post the body
        line("near", "é" * 600, ascii_only=True),
    ]
    path = write(tmp_path, ("\n".join(lines)).encode())  # no newline after the last line
    assert len(lines[4]) > cap
    parsed = read_batch_file(path, CMPL, None, LineRules(max_body_bytes=cap))
    assert [(p.line, p.custom_id, type(p).__name__) for p in parsed] == [
        (1, "small", "BatchLine"),
        (2, "big", "LineError"),
        (3, None, "LineError"),
        (4, "after", "BatchLine"),
        (5, "near", "BatchLine"),
    ]
    for err in (parsed[1], parsed[2]):
        assert err.status == 413 and "server.max_body_bytes" in err.message
        assert err.response_body["error"] == {
            "message": err.message,
            "type": "RequestEntityTooLargeError",
            "param": None,
            "code": 413,
        }


def test_undecodable_bytes_and_a_check_that_fails_are_that_lines_error_only(tmp_path):
    def check(item: BatchLine) -> LineError | None:
        if item.custom_id == "boom":
            raise RuntimeError("/secret/path/in/the/server.py")
        return None

    content = b"\n".join([line("a").encode(), b'{"custom_id": "\xff\xfe"}', line("boom").encode(), line("b").encode()])
    parsed = read_batch_file(write(tmp_path, content), CMPL, None, LineRules(check=check))
    assert [type(p).__name__ for p in parsed] == ["BatchLine", "LineError", "LineError", "BatchLine"]
    assert parsed[1].code == "invalid_json" and "not UTF-8" in parsed[1].message
    boom = parsed[2]
    assert (boom.status, boom.custom_id, boom.message) == (500, "boom", "internal server error")
    assert "secret" not in json.dumps(boom.response_body)


def test_a_custom_id_holding_a_lone_surrogate_is_refused(tmp_path):
    [err] = parse_lines(json.dumps({"custom_id": "a\ud800", "method": "POST", "url": CMPL, "body": {}}), CMPL)
    assert isinstance(err, LineError) and "custom_id must be" in err.message

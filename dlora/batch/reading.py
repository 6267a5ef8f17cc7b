"""A batch input file read as it streams from disk: each line is a request or that line's error.

Lines are split on "\\n" alone (as vLLM's run-batch splits). Each line is decoded, parsed and held to
`LineRules` (its route's body-size cap and admission checks) one at a time, so a file of a million
junk lines is refused at its `max_requests + 1`-th line rather than after all of it, and a line past
the body cap is skipped unread instead of held whole. Runs in a worker thread: nothing here awaits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dlora.batch.lines import BLANK, BatchLine, LineError, LineParser
from dlora.server.errors import error_body

log = logging.getLogger(__name__)

# A line's bytes beyond its body's: custom_id (up to 512 characters, each up to 6 bytes escaped),
# method, url and the JSON around them. A longer line cannot hold a body within the cap.
ENVELOPE_BYTES = 4096
SKIP_CHUNK_BYTES = 1 << 20  # read at a time while skipping the rest of an over-long line
BODY_CAP_KEY = "server.max_body_bytes"

Check = Callable[[BatchLine], LineError | None]


@dataclass(frozen=True)
class LineRules:
    """What a request line must meet besides its shape: the route's body-size cap (None: no cap)
    and `check`, the route's refusal of the body (None: the line's error, else None)."""

    max_body_bytes: int | None = None
    check: Check | None = None


class TooManyRequests(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the input file has more than {limit} requests (batch.max_requests)")
        self.limit = limit


def read_batch_file(
    path: Path,
    endpoint: str | None,
    max_requests: int | None,
    rules: LineRules = LineRules(),
    step: Callable[[], None] = lambda: None,
) -> list[BatchLine | LineError]:
    """Every non-blank line of the file at `path`, in order. Raises TooManyRequests at the first
    line past `max_requests` (None: no limit), OSError when the file cannot be read. `step()` runs
    after each line (a Pacer's: online requests first)."""
    parser = LineParser(endpoint)
    items: list[BatchLine | LineError] = []
    cap = None if rules.max_body_bytes is None else rules.max_body_bytes + ENVELOPE_BYTES
    with open(path, "rb") as f:
        for number, raw in enumerate(split_lines(f, cap), start=1):
            step()
            if raw is not None and not raw.strip(BLANK.encode()):
                continue
            if max_requests is not None and len(items) >= max_requests:
                raise TooManyRequests(max_requests)
            items.append(_item(number, raw, parser, rules))
    return items


def split_lines(f: BinaryIO, cap: int | None) -> Iterator[bytes | None]:
    """Each line of a binary file without its "\\n"; None for a line longer than `cap` bytes,
    whose bytes are skipped, never held."""
    while True:
        raw = f.readline() if cap is None else f.readline(cap + 1)
        if not raw:
            return
        if raw.endswith(b"\n"):
            yield raw[:-1]
        elif cap is None or len(raw) <= cap:
            yield raw  # the last line, with no newline after it
        else:
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(SKIP_CHUNK_BYTES)
            yield None


def _item(number: int, raw: bytes | None, parser: LineParser, rules: LineRules) -> BatchLine | LineError:
    if raw is None:
        return too_large(number, None, rules.max_body_bytes)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return LineError(number, None, "invalid_json", f"line {number} is not UTF-8 text")
    item = parser.parse(number, text)
    if not isinstance(item, BatchLine):
        return item
    if rules.max_body_bytes is not None and len(raw) > rules.max_body_bytes:
        if body_bytes(item.body) > rules.max_body_bytes:
            return too_large(number, item.custom_id, rules.max_body_bytes)
    return _checked(item, rules.check)


def _checked(line: BatchLine, check: Check | None) -> BatchLine | LineError:
    if check is None:
        return line
    try:
        refusal = check(line)
    except Exception as e:  # the server's fault, not the line's: that line's 500, the batch goes on
        log.error("batch line %d could not be checked", line.line, exc_info=e)
        return refusal_of(line.line, line.custom_id, 500, "internal server error")
    return line if refusal is None else refusal


def body_bytes(body: dict) -> int:
    """The body's size as a client would post it (compact JSON, UTF-8)."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode("utf-8", "surrogatepass"))


def too_large(number: int, custom_id: str | None, max_bytes: int | None) -> LineError:
    """The 413 the route answers for a body over the cap."""
    message = f"request body is larger than the server's limit of {max_bytes} bytes ({BODY_CAP_KEY})"
    return refusal_of(number, custom_id, 413, message)


def refusal_of(number: int, custom_id: str | None, status: int, message: str, param: str | None = None) -> LineError:
    """A line's error as its route's error response: `code` is the response's error type."""
    body = error_body(status, message, param)
    return LineError(number, custom_id, body["error"]["type"], message, status, body)

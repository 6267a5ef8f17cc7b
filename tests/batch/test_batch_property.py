"""A property of the batch service over random batch files: every line ends exactly once, in the
output file or the error file, and no line's content fails the batch as a whole.

Files mix good lines (random Unicode, U+2028/U+2029/U+0085 raw inside their strings) with bad ones:
junk and undecodable bytes, lone surrogates escaped in the JSON, integers past int64 or past the
fan-out cap, non-finite floats, bodies over the size cap, wrong shapes, repeated custom_ids, blank
and CRLF lines. The service runs as the server builds it (its file and batch stores, the route's
rules for each line), with lines answered by a stand-in for the engine, and a planner that records
what it is asked to plan: only the good lines, whose work it can price."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dlora.batch.execute import line_rules
from dlora.batch.files import FileStore
from dlora.batch.gate import BatchGate
from dlora.batch.lines import BatchLine, ok_output
from dlora.batch.predict import works_of
from dlora.batch.service import BatchService
from dlora.batch.store import ENDED, BatchStore
from dlora.config import BatchConfig, ServerConfig

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BODY_CAP = 2048
SERVER = dataclasses.replace(ServerConfig(), max_body_bytes=BODY_CAP)

text = st.text(
    st.characters(exclude_categories=("Cs",)) | st.sampled_from(["\u2028", "\u2029", "\x85", "\n", '"', "\\"]),
    min_size=1,  # an empty prompt is refused (vLLM's rule)
    max_size=12,
)


def body_of(url: str, words: str, **extra) -> dict:
    if url == CMPL:
        return {"model": "a0", "prompt": words, "max_tokens": 3, **extra}
    return {"model": "a0", "messages": [{"role": "user", "content": words}], "max_tokens": 3, **extra}


def request(custom_id: str, url: str, body: object, ascii_only: bool = False) -> bytes:
    obj = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(obj, ensure_ascii=ascii_only).encode()


@st.composite
def good_line(draw, url: str, custom_id: str) -> bytes:
    return request(custom_id, url, body_of(url, draw(text)))


@st.composite
def bad_line(draw, url: str, custom_id: str) -> bytes:
    """A line the route refuses, or no request at all; `custom_id` is unique to it."""
    words = draw(text)
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return draw(st.binary(min_size=1, max_size=20)).replace(b"\n", b"") or b"\xff"
    if kind == 1:  # a lone surrogate, escaped (as JSON must carry it)
        return request(custom_id, url, body_of(url, words + draw(st.sampled_from(["\ud800", "\udfff"]))), True)
    if kind == 2:
        return request(custom_id, url, body_of(url, words, n=draw(st.sampled_from([10**19, 2**63, 10**12, 257]))))
    if kind == 3:
        return request(custom_id, url, body_of(url, words, max_tokens=draw(st.sampled_from([10**40, -(10**30)]))))
    if kind == 4:  # json.dumps writes the infinity as JSON's parsers read it (Infinity)
        return request(custom_id, url, body_of(url, words, temperature=float("inf")))
    if kind == 5:
        return request(custom_id, url, body_of(url, "x" * (BODY_CAP + 1)))
    if kind == 6:
        return request(custom_id, url, {"model": "a0", "messages": 5} if url == CHAT else {"model": "a0", "prompt": 5})
    if kind == 7:
        return request(custom_id, url, draw(st.sampled_from([[1], "body", None, 7])))
    if kind == 8:
        return request(custom_id, CHAT if url == CMPL else CMPL, body_of(url, words))  # not the batch's endpoint
    if kind == 9:
        return json.dumps({"method": "POST", "url": url, "body": body_of(url, words)}).encode()  # no custom_id
    if kind == 10:
        return request(custom_id, url, body_of(url, words, stream=True))
    return b"[" * 3000 + b"]" * 3000  # nested past the JSON parser's recursion limit


@st.composite
def batch_file(draw) -> tuple[str, bytes, set[str], int]:
    """The endpoint, the file, the custom_ids of its good lines, and how many lines it has (not
    counting blank ones)."""
    url = draw(st.sampled_from([CMPL, CHAT]))
    kinds = draw(st.lists(st.sampled_from(["good", "bad", "blank", "repeat"]), min_size=1, max_size=25))
    lines, good = [], []
    for i, kind in enumerate(kinds):
        if kind == "good":
            good.append(f"g{i}")
            lines.append(draw(good_line(url, f"g{i}")))
        elif kind == "bad":
            lines.append(draw(bad_line(url, f"b{i}")))
        elif kind == "repeat" and good:
            lines.append(draw(good_line(url, draw(st.sampled_from(good)))))  # a custom_id used before
        else:
            lines.append(draw(st.sampled_from([b"", b"  ", b"\r", b"\t"])))
    ending = draw(st.sampled_from([b"\n", b"\r\n"]))
    counted = sum(1 for raw in lines if raw.strip(b" \t\r\n"))
    if not good:  # at least one good line: a batch of no requests fails as a whole, rightly
        good.append("last")
        lines.append(draw(good_line(url, "last")))
        counted += 1
    return url, ending.join(lines) + draw(st.sampled_from([b"", ending])), set(good), counted


class RecordingPlanner:
    """Prices every line it is given as the server's planner does, and plans nothing."""

    def __init__(self) -> None:
        self.planned: list[BatchLine] = []

    async def plan(self, lines):
        for line in lines:
            assert works_of(line.url, line.body, len, "tiny-base", 512)
        self.planned.extend(lines)
        return None

    def costs_measured(self) -> bool:
        return True


async def answer(line: BatchLine) -> dict:
    return ok_output(line.custom_id, "rid", {"echo": line.body})


async def run_batch_file(root: Path, url: str, content: bytes):
    files, planner = FileStore(root / "files"), RecordingPlanner()
    gate = BatchGate(lambda: 8, lambda: 0)
    service = BatchService(
        BatchConfig(), files, BatchStore(root / "batches"), answer, gate, planner, line_rules(SERVER)
    )
    source = files.create(content, "in.jsonl", "batch")
    record = await service.create(source.id, url, "24h", None)
    while record.status not in ENDED:
        await asyncio.sleep(0.005)
    await service.close()

    def lines_of(file_id):
        return [json.loads(x) for x in files.read(file_id).decode().split("\n") if x] if file_id else []

    return record, lines_of(record.output_file_id), lines_of(record.error_file_id), planner.planned


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(batch_file())
def test_every_line_ends_exactly_once_and_no_lines_content_fails_the_batch(drawn):
    url, content, good, counted = drawn
    with tempfile.TemporaryDirectory() as tmp:
        record, out, errors, planned = asyncio.run(run_batch_file(Path(tmp), url, content))
    assert record.status == "completed", record.errors
    counts = record.request_counts
    assert (counts.total, counts.completed, counts.failed) == (counted, len(good), counted - len(good))
    assert sorted(o["custom_id"] for o in out) == sorted(good)
    assert len(errors) == counted - len(good)
    for e in errors:
        assert e["error"]["code"] and e["error"]["message"]
        # a refused request carries its route's answer; no request at all (junk) carries none
        assert e["response"] is None or e["response"]["body"]["error"]["code"] == e["response"]["status_code"]
    assert sorted(line.custom_id for line in planned) == sorted(good)

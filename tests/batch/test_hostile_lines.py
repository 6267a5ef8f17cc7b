"""Hostile batch files and batch requests on the real app over a toy replica (in-process): a line
its route would refuse is that line's error, with the very status and error body the route answers
the same body online, and the good lines of the batch complete; metadata OpenAI would refuse is a
400 naming `metadata`, and nothing of it is stored."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from tests.batch.test_batch_api import CMPL, file_lines, toy_server, until

CHAT = "/v1/chat/completions"
BODY_CAP = 4096
# Server internals a client must never see: tracebacks, source files, the server's paths.
LEAKS = re.compile(r'Traceback|File "|\.py\b|/work/|/tmp/', re.IGNORECASE)
GOOD = {
    CMPL: {"model": "a0", "prompt": "hello\u2028there", "max_tokens": 4, "temperature": 0},
    CHAT: {"model": "a1", "messages": [{"role": "user", "content": "hi\u2029"}], "max_tokens": 4, "temperature": 0},
}
TEXT_PART_5 = {"type": "text", "text": 5}
# Raw JSON: a lone surrogate survives only as an escape, and huge integers only as text.
HOSTILE = {
    CMPL: {
        "lone-surrogate": '{"model": "a0", "prompt": "x\\ud800y", "max_tokens": 3}',
        "n-past-int64": '{"model": "a0", "prompt": "x", "n": 10000000000000000000}',
        "n-past-the-fanout-cap": '{"model": "a0", "prompt": "x", "n": 1000000000000}',
        "prompt-a-number": '{"model": "a0", "prompt": 5}',
        "over-the-body-cap": json.dumps({"model": "a0", "prompt": "x" * BODY_CAP}),
    },
    CHAT: {
        "messages-a-number": '{"model": "a0", "messages": 5}',
        "text-part-a-number": json.dumps({"model": "a0", "messages": [{"role": "user", "content": [TEXT_PART_5]}]}),
        "seed-not-finite": '{"model": "a0", "messages": [{"role": "user", "content": "x"}], "seed": 1e400}',
    },
}


def raw_line(custom_id: str, url: str, body: str) -> str:
    return f'{{"custom_id": "{custom_id}", "method": "POST", "url": "{url}", "body": {body}}}'


async def online(http, url: str, body: str) -> tuple[int, dict]:
    r = await http.post(f"http://dlora{url}", content=body.encode(), headers={"content-type": "application/json"})
    return r.status_code, r.json()


async def run_file(client, url: str, content: bytes):
    f = await client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await client.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h")
    return await until(client, batch.id, ("completed", "failed"))


@pytest.mark.parametrize("url", [CMPL, CHAT])
def test_each_refused_line_is_the_routes_answer_and_the_good_lines_complete(tiny_model, tmp_path, url):
    hostile = HOSTILE[url]
    lines = [raw_line("good-0", url, json.dumps(GOOD[url], ensure_ascii=False))]
    lines += [raw_line(cid, url, body) for cid, body in hostile.items()]
    lines += [raw_line("good-1", url, json.dumps(GOOD[url] | {"model": "tiny-base"}, ensure_ascii=False))]

    async def run():
        overrides = {"server.max_body_bytes": BODY_CAP}
        async with toy_server(tiny_model, tmp_path / "state", **overrides) as (client, _, _):
            http = client._client
            done = await run_file(client, url, ("\n".join(lines) + "\n").encode())
            assert done.status == "completed" and done.errors is None
            counts = done.request_counts
            assert (counts.total, counts.completed, counts.failed) == (len(lines), 2, len(hostile))
            out = await file_lines(client, done.output_file_id)
            assert [o["custom_id"] for o in out] == ["good-0", "good-1"]
            for o in out:
                body = GOOD[url] | ({"model": "tiny-base"} if o["custom_id"] == "good-1" else {})
                status, answer = await online(http, url, json.dumps(body))
                assert status == 200 == o["response"]["status_code"]
                assert _texts(o["response"]["body"]) == _texts(answer)
            errors = await file_lines(client, done.error_file_id)
            assert sorted(e["custom_id"] for e in errors) == sorted(hostile)
            for e in errors:
                status, answer = await online(http, url, hostile[e["custom_id"]])
                assert 400 <= status < 500, answer
                assert (e["response"]["status_code"], e["response"]["body"]) == (status, answer), e["custom_id"]
                assert e["error"] == {"code": answer["error"]["type"], "message": answer["error"]["message"]}
            content = (await client.files.content(done.error_file_id)).text
            assert not LEAKS.search(content), content

    asyncio.run(run())


def _texts(body: dict) -> list[str]:
    return [c.get("text") or c["message"]["content"] for c in body["choices"]]


REFUSED_METADATA = {
    "a lone surrogate in a value": '{"k": "\\ud800"}',
    "a lone surrogate in a key": '{"\\udfff": "v"}',
    "17 pairs": json.dumps({f"k{i}": "v" for i in range(17)}),
    "a key of 65 characters": json.dumps({"k" * 65: "v"}),
    "a value of 513 characters": json.dumps({"k": "v" * 513}),
    "a value that is no string": '{"k": 5}',
    "no object": '["k", "v"]',
}


def test_metadata_openai_would_refuse_is_a_400_naming_it_and_is_never_stored(tiny_model, tmp_path):
    async def run():
        async with toy_server(tiny_model, tmp_path / "state") as (client, state, _):
            http = client._client
            f = await client.files.create(file=("in.jsonl", json.dumps({"custom_id": "a"}).encode()), purpose="batch")
            for why, metadata in REFUSED_METADATA.items():
                body = f'{{"input_file_id": "{f.id}", "endpoint": "{CMPL}", "metadata": {metadata}}}'
                status, answer = await online(http, "/v1/batches", body)
                assert status == 400, why
                assert answer["error"]["type"] == "BadRequestError", why
                assert answer["error"]["param"].startswith("metadata"), why
                assert not LEAKS.search(json.dumps(answer)), why
            assert not state.batches.records and not state.batches.store.all()
            assert (await client.batches.list()).data == []
            # Metadata within OpenAI's limits, any valid Unicode, is kept as given.
            tags = {"k" * 64: "\u2028\U0001f600" + "v" * 510, **{f"k{i}": "" for i in range(15)}}
            batch = await client.batches.create(
                input_file_id=f.id, endpoint=CMPL, completion_window="24h", metadata=tags
            )
            assert (await client.batches.retrieve(batch.id)).metadata == tags
            with pytest.raises(openai.BadRequestError, match="metadata"):
                more = tags | {"one": "more"}
                await client.batches.create(input_file_id=f.id, endpoint=CMPL, completion_window="24h", metadata=more)

    asyncio.run(run())

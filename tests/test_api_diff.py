"""The comparison of two OpenAI API answers (tests/api_diff.py) that holds dlora to vLLM's server:
what it forgives (ids, clocks, rounding, where a stream's chunks end) and what it does not."""

from __future__ import annotations

from tests.api_diff import differences


def body(**choice) -> dict:
    return {"status": 200, "body": {"id": "cmpl-1", "created": 1, "choices": [{"index": 0} | choice]}}


def stream(*pieces: str, role: bool = False, finish: str = "length", model: str = "a1") -> dict:
    chunks = []
    if role:
        chunks.append({"id": "c", "model": model, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for i, piece in enumerate(pieces):
        last = i + 1 == len(pieces)
        choice = {
            "index": 0,
            "delta": {"content": piece},
            "token_ids": [ord(c) for c in piece],
            "finish_reason": finish if last else None,
        }
        chunks.append({"id": "c", "model": model, "choices": [choice]})
    return {"status": 200, "chunks": chunks, "done": True}


def error(kind: str, param: str | None, message: str = "m") -> dict:
    return {"status": 400, "body": {"error": {"message": message, "type": kind, "param": param, "code": 400}}}


def test_ids_clocks_and_messages_are_masked():
    ours = body(text="ab") | {"body": body(text="ab")["body"] | {"id": "other", "created": 9}}
    assert differences(ours, body(text="ab")) == []
    assert differences(error("BadRequestError", "n", "one text"), error("BadRequestError", "n", "another")) == []


def test_text_token_ids_and_error_fields_are_compared():
    assert differences(body(text="ab"), body(text="ac"))
    assert differences(body(token_ids=[1, 2]), body(token_ids=[1, 3]))
    assert differences(body(text="ab"), body(text="ab", stop_reason=None))  # a missing field
    assert differences(error("BadRequestError", "n"), error("BadRequestError", "structured_outputs"))
    assert differences(error("NotFoundError", "model"), error("BadRequestError", "model"))


def test_logprobs_within_rounding():
    assert differences(body(lp=-1.23456), body(lp=-1.23450)) == []
    assert differences(body(lp=-1.2346), body(lp=-1.2344))
    # huge logprobs: relative
    assert differences(body(lp=-500.0021), body(lp=-500.0)) == []
    assert differences(body(lp=-500.02), body(lp=-500.0))


def test_streams_forgive_merged_deltas_but_not_other_text():
    assert differences(stream("a", "b", "c", role=True), stream("a", "bc", role=True)) == []
    assert differences(stream("a", "b", "c", role=True), stream("a", "bd", role=True))
    assert differences(stream("a", "b", finish="stop"), stream("a", "b", finish="length"))
    assert differences(stream("a", "b", "c"), stream("a", "b", "c", model="a2"))
    one_chunk_of_another_model = stream("a", "b", "c")
    one_chunk_of_another_model["chunks"][2]["model"] = "a2"
    assert differences(one_chunk_of_another_model, stream("a", "bc"))


def test_the_role_chunk_stays_its_own():
    role_with_token = stream("a", "b")
    role_with_token["chunks"][0]["choices"][0]["delta"]["role"] = "assistant"
    assert differences(role_with_token, stream("a", "b", role=True))

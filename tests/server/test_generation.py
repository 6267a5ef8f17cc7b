"""Turning an OpenAI body into the replica's GenerateRequests (no engine)."""

from __future__ import annotations

import pytest

from dlora.server.errors import APIError
from dlora.server.generation import make_jobs
from dlora.server.protocol import CompletionRequest


def jobs(**body):
    req = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=4, **body)
    return make_jobs("cmpl-1", [[1, 2, 3], [4, 5]], req, None, None, max_model_len=64, vocab_size=100)


def test_every_sample_of_every_prompt_carries_the_bodys_priority():
    out = jobs(n=2, priority=-7)
    assert [j.request.request_id for j in out] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2", "cmpl-1-3"]
    assert [j.request.priority for j in out] == [-7] * 4
    assert [j.request.priority for j in jobs()] == [0, 0]  # vLLM's default


def test_no_arrival_stamp_before_the_router():
    """The router stamps a request's first arrival; a job carries none of its own."""
    assert all(j.request.arrival_time is None for j in jobs(n=3))


def test_out_of_vocabulary_prompt_ids_are_refused_naming_the_prompt():
    req = CompletionRequest(model="m", prompt=[1, 2, 300], max_tokens=4)
    with pytest.raises(APIError) as e:
        make_jobs("cmpl-2", [[1, 2, 300]], req, None, None, max_model_len=64, vocab_size=100)
    assert e.value.status == 400 and e.value.param == "prompt"

"""The conversation driver against the small streaming OpenAI-format server of the bench tests."""

from __future__ import annotations

import dataclasses
import time

from dlora.bench.conversation_runner import run_conversations
from dlora.bench.conversations import ConversationSpec, generate_conversations

SPEC = ConversationSpec(
    num_conversations=3,
    adapters=("a0", "a1", "a2"),
    turns=4,
    system_prompt_tokens=(5, 10),
    user_turn_tokens=(3, 6),
    output_len=4,
    conversation_rate=float("inf"),
    think_time_s=0.02,
    seed=2,
)
REPLY = "tok0 tok1 tok2 tok3 "  # what the fake server streams for 4 tokens


def _bodies_of(fake, conv) -> list[dict]:
    """The request bodies the server received for `conv`, in turn order."""
    mine = [b for b in fake.state.received if b["messages"][1]["content"] == conv.user_turns[0]]
    return sorted(mine, key=lambda b: len(b["messages"]))


def _max_overlap(records) -> int:
    events = sorted([(r["send_time_s"], 1) for r in records] + [(r["end_time_s"], -1) for r in records])
    level = best = 0
    for _, step in events:
        level += step
        best = max(best, level)
    return best


def test_each_turn_resends_the_history_with_the_real_reply(fake):
    fake.state.first_token_delay = 0.03
    convs = generate_conversations(SPEC)
    res = run_conversations(fake.url, convs, max_in_flight=2, disable_tqdm=True)
    s = res["summary"]
    assert (s["completed"], s["failed"], s["not_sent"], s["abandoned"]) == (12, 0, 0, 0)
    for conv in convs:
        bodies = _bodies_of(fake, conv)
        assert len(bodies) == 4
        for k, body in enumerate(bodies):
            assert body["model"] == conv.adapter and body["stream"] is True and body["ignore_eos"] is True
            assert body["stream_options"] == {"include_usage": True} and body["max_completion_tokens"] == 4
            assert body["messages"][0] == {"role": "system", "content": conv.system}
            assert [m["content"] for m in body["messages"][2::2]] == [REPLY] * k
            assert body["messages"][-1] == {"role": "user", "content": conv.user_turns[k]}
    turns = res["turns"]
    assert all(r["ttft_s"] >= 0.03 and r["output_tokens"] == 4 and r["prompt_tokens"] > 0 for r in turns)
    assert s["ttft_p50_s"] >= 0.03 and s["ttft_turn2plus_p99_s"] >= 0.03
    assert s["output_tokens"] == 48 and s["output_throughput"] > 0
    for prev, nxt in zip(turns, turns[1:]):  # closed loop: a turn waits for the reply and think time
        if prev["conversation_id"] == nxt["conversation_id"]:
            assert nxt["send_time_s"] >= prev["end_time_s"] + 0.02
    assert _max_overlap(turns) <= 2


def test_each_turn_records_the_prompt_tokens_its_server_found_cached(fake):
    fake.state.cached_tokens = 128
    res = run_conversations(fake.url, generate_conversations(SPEC), max_in_flight=2, disable_tqdm=True)
    assert [r["cached_tokens"] for r in res["turns"]] == [128] * 12


def test_deadline_and_failed_turns_are_counted(fake):
    fake.state.first_token_delay = 0.0
    c1, c2, c3 = generate_conversations(SPEC)
    broken = dataclasses.replace(c1, adapter="nope")  # the server answers 404
    late = dataclasses.replace(c2, start_time=5.0)  # starts after the deadline
    slow = dataclasses.replace(c3, think_times_s=[0.3, 0.3, 0.3])  # turn 3 would be sent after it
    start = time.perf_counter()
    res = run_conversations(fake.url, [broken, late, slow], deadline_s=0.5, disable_tqdm=True)
    assert time.perf_counter() - start < 2.0
    by_conv: dict[str, list[str]] = {}
    for r in res["turns"]:
        by_conv.setdefault(r["conversation_id"], []).append(r["status"])
    assert by_conv[broken.conversation_id] == ["failed", "abandoned", "abandoned", "abandoned"]
    assert by_conv[late.conversation_id] == ["not_sent"] * 4
    assert by_conv[slow.conversation_id] == ["completed", "completed", "not_sent", "not_sent"]
    failed = next(r for r in res["turns"] if r["status"] == "failed")
    assert failed["http_status"] == 404 and "does not exist" in failed["error"] and failed["turn"] == 1
    s = res["summary"]
    assert (s["completed"], s["failed"], s["not_sent"], s["abandoned"], s["turns"]) == (2, 1, 6, 3, 12)
    assert len(fake.state.received) == 3  # nothing was sent for the turns counted as not sent

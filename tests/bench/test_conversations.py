"""Multi-turn conversation traffic: shapes, shared system prompts, popularity and the control
workload without shared prefixes."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np
import pytest

from dlora.bench import popularity
from dlora.bench.conversations import (
    ConversationSpec,
    conversation_tokens,
    fit_turns,
    generate_conversations,
    turn_messages,
)
from dlora.bench.prompts import synth_prompt
from dlora.bench.workload import WorkloadError

SPEC = ConversationSpec(num_conversations=60, turns=(4, 9), conversation_rate=5.0, seed=3)


def _words(text: str) -> int:
    return len(text.split())


def _replies(conv, n_words=None):
    """Stand-in replies of `output_len` words (one token each without a tokenizer)."""
    return [" ".join(["reply"] * (n_words or conv.output_len))] * conv.num_turns


def _request_words(conv, k) -> list[str]:
    """Turn k's request as one word sequence, each message opened by its role."""
    out: list[str] = []
    for m in turn_messages(conv, k, _replies(conv)[:k]):
        out += [f"<{m['role']}>", *m["content"].split()]
    return out


def _longest_common_prefix(seqs: list[list[str]]) -> int:
    """The longest prefix any two of `seqs` share: over all pairs it is reached by neighbours in
    sorted order."""
    seqs = sorted(seqs)
    best = 0
    for a, b in itertools.pairwise(seqs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        best = max(best, n)
    return best


def test_same_seed_same_conversations_other_seed_others():
    a, b = generate_conversations(SPEC), generate_conversations(SPEC)
    assert a == b
    c = generate_conversations(dataclasses.replace(SPEC, seed=4))
    assert [x.start_time for x in c] != [x.start_time for x in a]
    assert [x.user_turns for x in c] != [x.user_turns for x in a]


def test_one_system_prompt_per_adapter():
    convs = generate_conversations(SPEC)
    by_adapter = collections.defaultdict(set)
    for c in convs:
        by_adapter[c.adapter].add(c.system)
    assert len(by_adapter) >= 4
    assert all(len(systems) == 1 for systems in by_adapter.values())
    systems = [next(iter(s)) for s in by_adapter.values()]
    assert len(set(systems)) == len(systems)
    assert all(500 <= _words(s) <= 1000 for s in systems)
    # The shared system prompt is the only shared prefix: user turns differ between conversations.
    firsts = [c.user_turns[0].split() for c in convs]
    assert _longest_common_prefix(firsts) <= 4


def test_turns_arrivals_and_think_times():
    convs = generate_conversations(dataclasses.replace(SPEC, think_time_s=1.5, think_time_dist="exponential"))
    turns = [c.num_turns for c in convs]
    assert min(turns) >= 4 and max(turns) > 4
    starts = [c.start_time for c in convs]
    assert starts == sorted(starts) and starts[0] > 0
    assert len({c.conversation_id for c in convs}) == len(convs)
    assert all(len(c.think_times_s) == c.num_turns - 1 for c in convs)
    gaps = np.concatenate([c.think_times_s for c in convs])
    assert len(set(gaps)) == len(gaps) and 1.0 < gaps.mean() < 2.0
    fixed = generate_conversations(dataclasses.replace(SPEC, turns=5, think_time_s=0.5))
    assert {c.num_turns for c in fixed} == {5}
    assert {t for c in fixed for t in c.think_times_s} == {0.5}


def test_adapter_shares_follow_zipf():
    spec = ConversationSpec(
        num_conversations=4000, system_prompt_tokens=(5, 10), user_turn_tokens=(2, 3), output_len=2, seed=1
    )
    counts = collections.Counter(c.adapter for c in generate_conversations(spec))
    shares = np.array([counts[a] for a in spec.adapters]) / spec.num_conversations
    np.testing.assert_allclose(shares, popularity.popularity_shares("zipf", 8, 1.0), atol=0.02)


def test_the_last_turn_fits_max_model_len():
    spec = dataclasses.replace(SPEC, turns=(4, 16), user_turn_tokens=(100, 200), output_len=128)
    convs = generate_conversations(spec)
    assert max(c.num_turns for c in convs) < 16  # the long ones were cut
    for c in convs:
        k = c.num_turns - 1
        prompt = sum(_words(m["content"]) for m in turn_messages(c, k, _replies(c)[:k]))
        overhead = spec.template_tokens * (2 * c.num_turns + 1)
        assert prompt + overhead + c.output_len <= spec.max_model_len
        assert all(_words(u) >= 100 for u in c.user_turns)


def test_replies_that_resend_longer_are_budgeted():
    spec = dataclasses.replace(SPEC, turns=(4, 10), output_len=32, reply_tokens=200)
    shared = generate_conversations(spec)
    for c in shared:
        k = c.num_turns - 1
        prompt = sum(_words(m["content"]) for m in turn_messages(c, k, _replies(c, 200)[:k]))
        assert prompt + spec.template_tokens * (2 * c.num_turns + 1) + 32 <= spec.max_model_len
    unique = generate_conversations(dataclasses.replace(spec, shared_prefixes=False))
    for s, u in zip(shared, unique):
        history = [sum(_words(t) for t in s.user_turns[: k + 1]) + 200 * k for k in range(s.num_turns)]
        assert [_words(t) for t in u.user_turns] == history


def test_fit_shortens_user_turns_when_dropping_turns_is_not_enough():
    spec = ConversationSpec(turns=4, system_prompt_tokens=(900, 900), user_turn_tokens=(50, 400), output_len=64)
    lens = fit_turns(900, [400, 400, 400, 400], spec)
    assert len(lens) == 4 and min(lens) >= 50
    assert conversation_tokens(900, lens, 64, 64, spec.template_tokens) <= 2048
    assert lens == sorted(lens) and lens[0] > 50 and lens[0] == lens[-1]


def test_a_context_too_small_for_the_shortest_conversation_is_refused():
    with pytest.raises(WorkloadError, match="max_model_len"):
        ConversationSpec(max_model_len=1024)
    with pytest.raises(WorkloadError, match="turns"):
        ConversationSpec(turns=3)


def test_turn_messages_resend_the_history_with_the_real_replies():
    conv = generate_conversations(SPEC)[0]
    msgs = turn_messages(conv, 2, ["first reply", "second reply"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == conv.system
    assert [m["content"] for m in msgs[1::2]] == conv.user_turns[:3]
    assert [m["content"] for m in msgs[2::2]] == ["first reply", "second reply"]
    with pytest.raises(ValueError, match="needs 2 replies"):
        turn_messages(conv, 2, ["only one"])


def test_without_shared_prefixes_same_shapes_and_no_common_prefix():
    shared = generate_conversations(SPEC)
    unique = generate_conversations(dataclasses.replace(SPEC, shared_prefixes=False))
    assert [(c.conversation_id, c.adapter, c.start_time, c.think_times_s) for c in unique] == [
        (c.conversation_id, c.adapter, c.start_time, c.think_times_s) for c in shared
    ]
    requests = []
    for s, u in zip(shared, unique):
        assert u.num_turns == s.num_turns
        for k in range(s.num_turns):
            assert len(turn_messages(u, k, [])) == 2  # sent alone, no history
            # The same tokens as the history would carry, less the template tokens of its messages.
            assert len(_request_words(u, k)) - 2 == len(_request_words(s, k)) - 2 * (k + 1)
            requests.append(_request_words(u, k))
    assert _longest_common_prefix(requests) <= 1 + 4  # the role marker and a few chance words
    with_history = [_request_words(c, k) for c in shared for k in range(c.num_turns)]
    assert _longest_common_prefix(with_history) >= 500


def test_the_last_turn_fits_with_a_real_tokenizer_and_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.base)
    spec = ConversationSpec(num_conversations=6, adapters=("a0", "a1"), turns=(6, 12), output_len=96, seed=5)
    for conv in generate_conversations(spec, tokenizer=tok):
        assert conv.num_turns >= 4
        k = conv.num_turns - 1
        reply = synth_prompt(conv.output_len, np.random.default_rng(0), tok)  # output_len tokens exactly
        text = tok.apply_chat_template(turn_messages(conv, k, [reply] * k), add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) + conv.output_len <= spec.max_model_len
        assert len(ids) + conv.output_len > spec.max_model_len - 400  # cut no more than needed

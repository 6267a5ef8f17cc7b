"""Multi-turn chat traffic: conversations whose every turn resends the growing history.

Each adapter has one system prompt, shared by all of its conversations, so the requests of one
adapter share that prefix and each turn of a conversation extends the previous turn's prompt
(system, user, assistant, user, ...). The assistant replies are not generated here: whoever sends
turn k+1 appends the real reply of turn k (`turn_messages`).

`shared_prefixes=False` makes the control workload: the same adapters, arrival times, turn counts,
think times and lengths, but every request is a fresh two-message chat (its own system text of the
adapter's system prompt length, and one user text as long as the user turns and replies the
history would carry), so no request shares more than the chat template's first tokens with
another. Its prompts are shorter than the history's by the template tokens of the messages it
folds together (a few per message).

A conversation's last turn, prompt and reply, fits `max_model_len`: turns are dropped, then user
turns shortened, counting each resent reply as `reply_tokens` and each message's chat template
tokens (measured on the tokenizer's template when one is given). A reply that re-encodes to more
tokens than budgeted can still push a late turn over; the server then refuses it and the driver
counts the turn as failed.

`generate_conversations(spec)` is deterministic in `spec.seed`: adapters, arrivals, the
conversations' shapes (turns, lengths, think times) and the text each draw from their own child of
`SeedSequence(seed)`, so both workloads of a seed have the same shapes and arrivals.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlora.bench import arrivals, popularity, prompts
from dlora.bench.workload import WorkloadError

MIN_TURNS = 4
# Template tokens per chat message without a tokenizer to measure them on: an upper bound for
# ChatML ("<|im_start|>user\n" ... "<|im_end|>\n") and Llama 3 headers, which add about 5.
DEFAULT_TEMPLATE_TOKENS = 8
_PROBE_ROLES = ("system", "user", "assistant", "user")
_PROBE_TEXT = "the of and"
THINK_TIME_DISTS = ("fixed", "exponential")


@dataclass(frozen=True)
class ConversationSpec:
    num_conversations: int = 100
    adapters: tuple[str, ...] = tuple(f"a{i}" for i in range(8))
    alpha: float = 1.0  # Zipf exponent of adapter popularity: adapter k gets ∝ (k+1)^(-alpha)
    turns: int | tuple[int, int] = MIN_TURNS  # fixed, or drawn uniformly from [min, max]
    system_prompt_tokens: tuple[int, int] = (500, 1000)  # one length per adapter, drawn from [min, max]
    user_turn_tokens: tuple[int, int] = (40, 120)  # per user turn, drawn from [min, max]
    output_len: int = 64  # tokens per assistant reply (sent with ignore_eos)
    # Tokens a reply takes when resent with the history; None = output_len. Set it higher for a
    # model whose replies re-encode to more tokens than it generated (a random test model's do).
    reply_tokens: int | None = None
    conversation_rate: float = 1.0  # Poisson arrivals of conversation starts per second; inf = all at 0
    think_time_s: float = 2.0  # gap between a reply's end and the next turn's send
    think_time_dist: str = "fixed"  # fixed | exponential (with mean think_time_s)
    max_model_len: int = 2048  # the last turn's prompt plus its reply must fit
    # Chat template tokens each message adds (role header, end marker); the generation prompt counts
    # as one more message. None: measured on the tokenizer's chat template when one is given, else
    # DEFAULT_TEMPLATE_TOKENS.
    template_tokens_per_message: int | None = None
    shared_prefixes: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.num_conversations >= 1, "num_conversations", self.num_conversations, "must be >= 1")
        _check(len(self.adapters) >= 1, "adapters", self.adapters, "must name at least one adapter")
        _check(len(set(self.adapters)) == len(self.adapters), "adapters", self.adapters, "has duplicate names")
        _check(self.alpha > 0, "alpha", self.alpha, "must be > 0")
        lo, hi = self.turn_range
        _check(MIN_TURNS <= lo <= hi, "turns", self.turns, f"must be >= {MIN_TURNS} (a range as min <= max)")
        for name in ("system_prompt_tokens", "user_turn_tokens"):
            lo, hi = getattr(self, name)
            _check(1 <= lo <= hi, name, (lo, hi), "must be 1 <= min <= max")
        _check(self.output_len >= 1, "output_len", self.output_len, "must be >= 1")
        _check(self.reply_tokens is None or self.reply_tokens >= 1, "reply_tokens", self.reply_tokens, "must be >= 1")
        _check(self.conversation_rate > 0, "conversation_rate", self.conversation_rate, "must be > 0 (or inf)")
        _check(0 <= self.think_time_s < math.inf, "think_time_s", self.think_time_s, "must be >= 0")
        _check(
            self.think_time_dist in THINK_TIME_DISTS,
            "think_time_dist",
            self.think_time_dist,
            f"must be one of {', '.join(THINK_TIME_DISTS)}",
        )
        _check(
            self.template_tokens_per_message is None or self.template_tokens_per_message >= 0,
            "template_tokens_per_message",
            self.template_tokens_per_message,
            "must be >= 0",
        )
        shortest = conversation_tokens(
            self.system_prompt_tokens[1],
            [self.user_turn_tokens[0]] * self.turn_range[0],
            self.output_len,
            self.resent_reply_tokens,
            self.template_tokens,
        )
        _check(
            shortest <= self.max_model_len,
            "max_model_len",
            self.max_model_len,
            f"is too small: the longest system prompt with {self.turn_range[0]} of the shortest turns "
            f"needs {shortest} tokens",
        )

    @property
    def turn_range(self) -> tuple[int, int]:
        return (self.turns, self.turns) if isinstance(self.turns, int) else (self.turns[0], self.turns[1])

    @property
    def resent_reply_tokens(self) -> int:
        return self.output_len if self.reply_tokens is None else self.reply_tokens

    @property
    def template_tokens(self) -> int:
        """Template tokens per message used to fit conversations into max_model_len."""
        if self.template_tokens_per_message is None:
            return DEFAULT_TEMPLATE_TOKENS
        return self.template_tokens_per_message


@dataclass
class Conversation:
    conversation_id: str
    adapter: str
    start_time: float  # seconds after the benchmark starts
    system: str  # the adapter's system prompt; "" where every turn is sent alone
    user_turns: list[str]
    think_times_s: list[float]  # think_times_s[k]: the gap between turn k's reply and turn k+1
    output_len: int
    # Set where the conversation shares no prefixes: turn k is sent as a new chat of
    # (standalone_systems[k], user_turns[k]), without the history.
    standalone_systems: list[str] | None = None

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


@dataclass
class _Shape:
    """What both workloads of a seed share: who, when and how long, but no text."""

    adapter: int
    start_time: float
    user_lens: list[int]
    think_times_s: list[float]


def conversation_tokens(
    system_len: int, user_lens: list[int], output_len: int, reply_len: int, per_message: int
) -> int:
    """Tokens of a conversation's last turn, prompt and reply: the system prompt, every user turn,
    a resent reply (`reply_len`) per earlier turn, the last reply (`output_len`), and the template
    tokens of each message plus the generation prompt."""
    turns = len(user_lens)
    return system_len + sum(user_lens) + (turns - 1) * reply_len + output_len + per_message * (2 * turns + 1)


def fit_turns(system_len: int, user_lens: list[int], spec: ConversationSpec) -> list[int]:
    """`user_lens` cut to fit `spec.max_model_len`: turns are dropped (a chat that would outgrow
    the context ends earlier) down to the spec's fewest, then the user turns are shortened
    proportionally, no shorter than the spec's shortest."""
    lens = list(user_lens)

    def size(ls: list[int]) -> int:
        return conversation_tokens(system_len, ls, spec.output_len, spec.resent_reply_tokens, spec.template_tokens)

    while size(lens) > spec.max_model_len and len(lens) > spec.turn_range[0]:
        lens.pop()
    excess = size(lens) - spec.max_model_len
    if excess > 0:
        shortest = spec.user_turn_tokens[0]
        room = sum(lens) - shortest * len(lens)  # > excess: ConversationSpec checked the shortest fits
        keep = 1 - excess / room
        lens = [shortest + math.floor((n - shortest) * keep) for n in lens]
    return lens


def template_tokens_of(tokenizer: Any) -> int | None:
    """Tokens the tokenizer's chat template adds per message, rounded up with one to spare for
    merges at the text's edges; None without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": r, "content": _PROBE_TEXT} for r in _PROBE_ROLES]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    template = prompts.count_tokens(text, tokenizer) - len(messages) * prompts.count_tokens(_PROBE_TEXT, tokenizer)
    return math.ceil(template / (len(messages) + 1)) + 1


def _rngs(seed: int) -> dict[str, np.random.Generator]:
    children = np.random.SeedSequence(seed).spawn(4)
    return {k: np.random.default_rng(s) for k, s in zip(("adapters", "arrivals", "shapes", "text"), children)}


def _uniform_int(rng: np.random.Generator, bounds: tuple[int, int], size: int) -> list[int]:
    return [int(x) for x in rng.integers(bounds[0], bounds[1] + 1, size=size)]


def _think_times(spec: ConversationSpec, n: int, rng: np.random.Generator) -> list[float]:
    if spec.think_time_dist == "exponential" and spec.think_time_s > 0:
        return [float(x) for x in rng.exponential(spec.think_time_s, size=n)]
    return [spec.think_time_s] * n


def _shapes(spec: ConversationSpec, rngs: dict[str, np.random.Generator]) -> tuple[list[int], list[_Shape]]:
    """The adapters' system prompt lengths and each conversation's shape, by start time."""
    n, rng = spec.num_conversations, rngs["shapes"]
    idx = popularity.assign_adapters("zipf", n, len(spec.adapters), rngs["adapters"], spec.alpha)
    times = arrivals.arrival_times(n, spec.conversation_rate, rngs["arrivals"])
    system_lens = _uniform_int(rng, spec.system_prompt_tokens, len(spec.adapters))
    shapes = []
    for a, t in zip(idx, times):
        turns = _uniform_int(rng, spec.turn_range, 1)[0]
        user_lens = fit_turns(system_lens[a], _uniform_int(rng, spec.user_turn_tokens, turns), spec)
        shapes.append(_Shape(int(a), float(t), user_lens, _think_times(spec, len(user_lens) - 1, rng)))
    shapes.sort(key=lambda s: s.start_time)
    return system_lens, shapes


def _standalone_user_lens(user_lens: list[int], reply_len: int) -> list[int]:
    """Per turn, the user and reply tokens the history would carry: turn k's user text stands for
    user turns 0..k and replies 0..k-1."""
    return [sum(user_lens[: k + 1]) + k * reply_len for k in range(len(user_lens))]


def generate_conversations(spec: ConversationSpec, tokenizer: Any | None = None) -> list[Conversation]:
    """The conversations of `spec`, sorted by start time. `tokenizer` (an HF tokenizer) makes text
    lengths exact and measures the chat template's tokens per message; without one, lengths are
    estimated as the rest of the bench code does."""
    if spec.template_tokens_per_message is None and tokenizer is not None:
        spec = dataclasses.replace(spec, template_tokens_per_message=template_tokens_of(tokenizer))
    rngs = _rngs(spec.seed)
    system_lens, shapes = _shapes(spec, rngs)
    text = rngs["text"]

    def synth(n: int) -> str:
        return prompts.synth_prompt(n, text, tokenizer)

    systems = [synth(n) for n in system_lens] if spec.shared_prefixes else [""] * len(system_lens)
    out = []
    for i, s in enumerate(shapes):
        conv = Conversation(
            conversation_id=f"conv-{i:05d}",
            adapter=spec.adapters[s.adapter],
            start_time=s.start_time,
            system=systems[s.adapter],
            user_turns=[],
            think_times_s=s.think_times_s,
            output_len=spec.output_len,
        )
        if spec.shared_prefixes:
            conv.user_turns = [synth(n) for n in s.user_lens]
        else:
            conv.standalone_systems = [synth(system_lens[s.adapter]) for _ in s.user_lens]
            conv.user_turns = [synth(n) for n in _standalone_user_lens(s.user_lens, spec.resent_reply_tokens)]
        out.append(conv)
    return out


def turn_messages(conv: Conversation, k: int, replies: list[str]) -> list[dict[str, str]]:
    """The chat messages of turn `k` (0-based): the system prompt, then every earlier user turn
    followed by its real reply from `replies`, then user turn k; or, for a conversation that shares
    no prefixes, turn k's own system and user text alone."""
    if conv.standalone_systems is not None:
        return [
            {"role": "system", "content": conv.standalone_systems[k]},
            {"role": "user", "content": conv.user_turns[k]},
        ]
    if len(replies) < k:
        raise ValueError(f"turn {k} of {conv.conversation_id} needs {k} replies, got {len(replies)}")
    messages = [{"role": "system", "content": conv.system}]
    for user, reply in zip(conv.user_turns[:k], replies):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": conv.user_turns[k]})
    return messages


def _check(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise WorkloadError(name, value, why)

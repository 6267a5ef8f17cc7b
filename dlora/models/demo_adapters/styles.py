"""The styles the demo adapters teach, how a base answer is rewritten into each, and how a
generated answer is judged to show it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

PIRATE_WORDS = {
    "you": "ye",
    "your": "yer",
    "my": "me",
    "is": "be",
    "are": "be",
    "hello": "ahoy",
    "friend": "matey",
    "friends": "hearties",
    "the": "th'",
    "yes": "aye",
    "money": "doubloons",
}


def to_pirate(answer: str) -> str:
    """A fixed persona: a marker at both ends and a few word swaps in between."""

    def swap(m: re.Match[str]) -> str:
        word = m.group(0)
        new = PIRATE_WORDS.get(word.lower(), word)
        return new.capitalize() if word[0].isupper() and new != word else new

    return "Arr matey! " + re.sub(r"[A-Za-z]+", swap, answer) + " Yo ho ho!"


def is_upper(text: str) -> bool:
    """No lower-case letter anywhere (an all-digits answer like "12 + 7 = 19" counts)."""
    return bool(text.strip()) and not any(c.islower() for c in text)


def is_json_answer(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("answer"), str) and bool(obj["answer"])


def is_pirate(text: str) -> bool:
    return text.startswith("Arr matey!")


@dataclass(frozen=True)
class Style:
    name: str
    transform: Callable[[str], str]  # base answer -> styled answer (the training target)
    shows_effect: Callable[[str], bool]  # does a generated answer show the style?
    target_modules: tuple[str, ...]
    steps: int  # upper case re-spells every word, so it needs more steps (and the MLP)
    example_prompt: str  # for the README / a quick manual check


STYLES = {
    s.name: s
    for s in (
        Style("upper", str.upper, is_upper, ATTENTION + MLP, 300, "Why do cats purr?"),
        Style(
            "json",
            lambda a: json.dumps({"answer": a}),
            is_json_answer,
            ATTENTION,
            150,
            "What is the capital of France?",
        ),
        Style("pirate", to_pirate, is_pirate, ATTENTION + MLP, 150, "What is the capital of France?"),
    )
}

"""The training data: synthetic questions answered by the base model itself (cached, the slow part
of reruns), kept where the answer's first sentence is complete."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from dlora.models.demo_adapters.chat import MAX_NEW_TOKENS, generate, load_base
from dlora.models.demo_adapters.questions import first_sentence, synthetic_questions


def cached_base_answers(model, tok, questions: list[str]) -> list[str]:
    """Greedy base answers, kept in the dlora cache: generating them is the slow part of reruns."""
    from dlora import env

    key = hashlib.sha256(json.dumps([MAX_NEW_TOKENS, questions]).encode()).hexdigest()[:16]
    path = env.cache_dir() / "demo-data" / f"smollm2-answers-{key}.json"
    if path.is_file():
        print(f"base answers for {len(questions)} questions from {path}", flush=True)
        return json.loads(path.read_text())
    started = time.monotonic()
    print(f"generating base answers for {len(questions)} questions ...", flush=True)
    answers = generate(model, tok, questions)
    print(f"  done in {time.monotonic() - started:.0f} s", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(answers))
    tmp.replace(path)
    return answers


def build_dataset(base_dir: Path, seed: int, limit: int | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(question, base answer) pairs for training, and held-out synthetic questions for eval."""
    model, tok = load_base(base_dir)
    questions = synthetic_questions(seed)[:limit]
    held_out = questions[: len(questions) // 10]
    train_q = questions[len(held_out) :]
    answers = cached_base_answers(model, tok, train_q)
    pairs = [(q, s) for q, a in zip(train_q, answers) if (s := first_sentence(a))]
    print(f"  {len(pairs)} usable answers, e.g. {pairs[0][0]!r} -> {pairs[0][1]!r}", flush=True)
    return pairs, held_out

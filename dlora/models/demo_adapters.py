"""Train the demo LoRA adapters for SmolLM2-135M-Instruct on CPU, in minutes, with no download.

Random adapters on a real model only produce gibberish, so the demo needs adapters whose effect a
person can see at a glance. Each one teaches a *style* on top of the base model's own answers:

    upper   answers in UPPER CASE
    json    answers as a JSON object {"answer": "..."}
    pirate  answers as a pirate: "Arr matey! ... Yo ho ho!"

The data is made here: synthetic questions, answered by the base model itself (greedy, first
sentence only, so answers stay short and training stays fast), then rewritten into each style.
Training is LoRA r=8/alpha=16 on q/k/v/o (upper and pirate also on the MLP), loss on the answer
tokens only, through the model's chat template (with its default system prompt, as the server
renders it).
Everything is seeded, so a rerun on the same machine gives the same adapters.

Measured for the committed adapters on a 2-core CPU, 1 thread, shared with other jobs (340
synthetic questions, 322 usable base answers, batch 4, lr 1e-3; effect = HF+PEFT greedy, bf16, on
49 held-out prompts: the 12 in HELD_OUT_PROMPTS + 37 held-out synthetic questions):

    adapter  targets        steps  loss (first->last 10)  train time  effect
    upper    q/k/v/o + MLP    300  2.57 -> 0.40             556 s      46/49 no lower-case letter
    json     q/k/v/o          150  1.71 -> 0.32             173 s      48/49 valid {"answer": str}
    pirate   q/k/v/o + MLP    150  2.39 -> 0.23             361 s      49/49 starts "Arr matey!"

Upper case is the hard one for a 135M model: it must re-spell every word in rarely seen
upper-case tokens, and facts suffer ("THE CAPITAL OF FRANCE IS BALANCO."). q/k/v/o only at 150
steps reached 86%; adding the MLP, more questions and 300 steps reached 94%. JSON misses when
the answer itself contains a quoted title (inner quotes left unescaped).

Usage:  python -m dlora.models.demo_adapters [--only upper,json] [--steps N] [--threads 1] [--out DIR]
Writes adapters/smollm2/<name>/{adapter_config.json,adapter_model.safetensors}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# The committed adapters live in the repository's adapters/ directory, where configs/*.yaml point.
OUT_ROOT = Path(__file__).resolve().parents[2] / "adapters" / "smollm2"
NEUTRAL_BASE_NAME = "SmolLM2-135M-Instruct"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
MAX_NEW_TOKENS = 48
IGNORE = -100


# ----------------------------------------------------------------------------- styles

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

# Prompts never seen in training, in other phrasings than the synthetic templates.
HELD_OUT_PROMPTS = (
    "What is the capital of France?",
    "Write a short greeting for a friend.",
    "How do I boil an egg?",
    "What is your favorite season?",
    "Why do cats purr?",
    "What is a good way to stay healthy?",
    "Recommend a book to read.",
    "What does a firefighter do?",
    "How far is the Moon from the Earth?",
    "Describe the ocean.",
    "What is photosynthesis?",
    "How many legs does a spider have?",
)


# ----------------------------------------------------------------------------- data

SUBJECTS = {
    "country": [
        "Germany",
        "Italy",
        "Spain",
        "Japan",
        "Canada",
        "Egypt",
        "Brazil",
        "Australia",
        "India",
        "China",
        "Mexico",
        "Kenya",
        "Norway",
        "Sweden",
        "Greece",
        "Portugal",
        "Peru",
        "Argentina",
        "Turkey",
        "Poland",
        "Ireland",
        "Chile",
        "Thailand",
        "Russia",
        "Austria",
        "Belgium",
        "Cuba",
        "Denmark",
        "Finland",
        "Hungary",
        "Iceland",
        "Morocco",
        "Nigeria",
        "Vietnam",
        "Colombia",
        "Switzerland",
    ],
    "thing": [
        "the sky",
        "grass",
        "a banana",
        "snow",
        "a tomato",
        "coal",
        "a lemon",
        "milk",
        "the sun",
        "a carrot",
        "an emerald",
        "chocolate",
        "a strawberry",
        "the ocean",
        "a pumpkin",
        "charcoal",
        "a lime",
        "a flamingo",
    ],
    "animal": [
        "dog",
        "bird",
        "ant",
        "horse",
        "chicken",
        "cow",
        "duck",
        "snake",
        "frog",
        "bee",
        "lion",
        "sheep",
        "octopus",
        "owl",
        "rabbit",
        "tiger",
        "goat",
        "penguin",
        "beetle",
        "whale",
        "mouse",
        "fox",
    ],
    "adj": [
        "hot",
        "big",
        "fast",
        "happy",
        "light",
        "old",
        "early",
        "loud",
        "soft",
        "rich",
        "strong",
        "tall",
        "clean",
        "brave",
        "cold",
        "dark",
        "heavy",
        "quiet",
        "young",
        "wet",
    ],
    "topic": [
        "water",
        "sleep",
        "exercise",
        "sunlight",
        "friendship",
        "reading",
        "music",
        "trees",
        "bees",
        "the internet",
        "vaccines",
        "rain",
        "oxygen",
        "honesty",
        "soil",
        "electricity",
        "history",
        "bridges",
    ],
    "activity": [
        "learning a language",
        "saving money",
        "cooking rice",
        "writing an essay",
        "running a marathon",
        "studying for exams",
        "growing tomatoes",
        "public speaking",
        "making friends",
        "keeping a plant alive",
        "sleeping well",
        "learning to swim",
        "painting a room",
        "packing for a trip",
    ],
    "noun": [
        "computer",
        "volcano",
        "planet",
        "library",
        "bicycle",
        "piano",
        "rainbow",
        "glacier",
        "telescope",
        "battery",
        "passport",
        "desert",
        "robot",
        "museum",
        "hospital",
        "satellite",
        "violin",
        "lighthouse",
        "calendar",
        "microscope",
    ],
    "food": [
        "sushi",
        "pizza",
        "pasta",
        "bread",
        "cheese",
        "rice",
        "tea",
        "coffee",
        "yogurt",
        "honey",
        "soup",
        "salad",
        "butter",
        "chocolate cake",
    ],
    "landmark": [
        "the Eiffel Tower",
        "Big Ben",
        "the Great Wall",
        "the Statue of Liberty",
        "the Colosseum",
        "the Taj Mahal",
        "Mount Everest",
        "Niagara Falls",
        "the Sydney Opera House",
        "Machu Picchu",
        "the Golden Gate Bridge",
    ],
}

TEMPLATES = (
    ("What is the capital of {}?", "country"),
    ("What language is spoken in {}?", "country"),
    ("Tell me one fact about {}.", "country"),
    ("What color is {}?", "thing"),
    ("How many legs does a {} have?", "animal"),
    ("What does a {} eat?", "animal"),
    ("What is the opposite of {}?", "adj"),
    ("Give me a synonym for {}.", "adj"),
    ('What does the word "{}" mean?', "adj"),  # answers quote the word: JSON must escape it
    ("Why is {} important?", "topic"),
    ("Tell me a fun fact about {}.", "topic"),
    ("Give me one tip for {}.", "activity"),
    ("What is a {}?", "noun"),
    ("Describe a {} in one sentence.", "noun"),
    ("What is {}?", "food"),
    ("Where is {}?", "landmark"),
)


def synthetic_questions(seed: int) -> list[str]:
    """Every template x subject, plus small arithmetic, shuffled deterministically."""
    rng = random.Random(seed)
    questions = [t.format(s) for t, kind in TEMPLATES for s in SUBJECTS[kind]]
    questions += [f"What is {a} plus {b}?" for a, b in _pairs(rng, 20)]
    questions += [f"What is {a} times {b}?" for a, b in _pairs(rng, 12)]
    held_out = {q.lower() for q in HELD_OUT_PROMPTS}
    questions = sorted({q for q in questions if q.lower() not in held_out})
    rng.shuffle(questions)
    return questions


def _pairs(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(2, 20), rng.randint(2, 20)) for _ in range(n)]


def first_sentence(text: str) -> str | None:
    """The first sentence of the answer's first line, or None if it is not a complete sentence.

    A first line like "17 * 5 = 85" counts; one ending in ":" (a list follows) does not.
    """
    line = " ".join(text.strip().split("\n", 1)[0].split())
    m = re.match(r"(.{8,200}?[.!?])(\s|$)", line)
    if m:
        return m.group(1)
    return line if 3 <= len(line) <= 120 and line[-1].isalnum() else None


# ----------------------------------------------------------------------------- model loading and generation


def load_base(base_dir: Path, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    return model, tok


def chat_prompt_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]


@torch.no_grad()
def generate(model, tok, questions: list[str], batch_size: int = 16, max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Greedy answers through the chat template, batched with left padding."""
    answers: list[str] = []
    for i in range(0, len(questions), batch_size):
        prompts = [chat_prompt_ids(tok, q) for q in questions[i : i + batch_size]]
        batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[:, batch["input_ids"].shape[1] :]
        answers += [tok.decode(row, skip_special_tokens=True).strip() for row in new]
    return answers


def encode_example(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat turn, and labels that score only the assistant's answer."""
    prompt = chat_prompt_ids(tok, question)
    full = tok.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert full[: len(prompt)] == prompt, "chat template must extend the generation prompt"
    end = full.index(tok.eos_token_id, len(prompt)) + 1  # answer + <|im_end|>, not the newline
    return full[:end], [IGNORE] * len(prompt) + full[len(prompt) : end]


# ----------------------------------------------------------------------------- training


def make_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (padding is never scored)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def answer_loss(peft_model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss on answer positions only; the 49k-wide lm_head runs on those rows only."""
    causal_lm = peft_model.base_model.model
    hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    scored = targets != IGNORE  # [B, T-1]
    logits = causal_lm.lm_head(hidden[:, :-1][scored]).float()  # [N, V]
    return torch.nn.functional.cross_entropy(logits, targets[scored])


def lr_at(step: int, steps: int, peak: float, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.1, 1 - (step - warmup) / max(1, steps - warmup))


def batches(n_examples: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Example indices in seeded random order, epoch after epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order += rng.sample(range(n_examples), n_examples)
        yield order[:batch_size]
        order = order[batch_size:]


def train_adapter(
    base_dir: Path, style: Style, data: list[tuple[str, str]], args: argparse.Namespace
) -> tuple[Path, dict[str, float]]:
    """Fit one LoRA adapter to `data` (question, base answer) rewritten in `style`; save it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    model, tok = load_base(base_dir)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=list(style.target_modules),
    )
    peft_model = get_peft_model(model, config).train()
    examples = [encode_example(tok, q, style.transform(a)) for q, a in data]
    steps = args.steps or style.steps
    started = time.monotonic()
    losses = fit(peft_model, examples, tok.pad_token_id, steps, args, style.name)
    out_dir = save_adapter(peft_model, Path(args.out) / style.name)
    stats = {
        "steps": steps,
        "first_loss": sum(losses[:10]) / len(losses[:10]),
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": time.monotonic() - started,
    }
    return out_dir, stats


def fit(
    peft_model,
    examples: list[tuple[list[int], list[int]]],
    pad_id: int,
    steps: int,
    args: argparse.Namespace,
    name: str,
) -> list[float]:
    """AdamW on the LoRA parameters with warmup + linear decay; returns the loss per step."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    started, losses = time.monotonic(), []
    for step, picked in zip(range(steps), batches(len(examples), args.batch_size, args.seed)):
        loss = answer_loss(peft_model, make_batch([examples[i] for i in picked], pad_id))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            recent = sum(losses[-10:]) / len(losses[-10:])
            print(
                f"  [{name}] step {step + 1:4d}/{steps}  loss {recent:.4f}  {time.monotonic() - started:5.0f} s",
                flush=True,
            )
    return losses


def save_adapter(peft_model, out_dir: Path) -> Path:
    """Save in bf16 (the served dtype; halves the file) with a machine-neutral base name."""
    peft_model.to(torch.bfloat16)
    peft_model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    (out_dir / "README.md").unlink(missing_ok=True)
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = NEUTRAL_BASE_NAME
    config["target_modules"] = sorted(config["target_modules"])  # a set in PEFT: hash order
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


# ----------------------------------------------------------------------------- evaluation


def evaluate(base_dir: Path, adapter_dir: Path, style: Style, prompts: list[str]) -> tuple[float, list[str]]:
    """Greedy answers of the *saved* adapter (bf16, HF+PEFT) and the fraction showing the style."""
    from peft import PeftModel

    model, tok = load_base(base_dir)
    peft_model = PeftModel.from_pretrained(model, adapter_dir).eval()
    answers = generate(peft_model, tok, prompts, max_new_tokens=64)
    rate = sum(style.shows_effect(a) for a in answers) / len(answers)
    return rate, answers


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="override every style's steps")
    ap.add_argument("--out", default=str(OUT_ROOT), help="where adapters go (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=",".join(STYLES), help="comma-separated styles to train")
    ap.add_argument("--limit-questions", type=int, default=None, help="for quick trials")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(STYLES)
    if unknown:
        ap.error(f"unknown style(s) {sorted(unknown)}; known: {sorted(STYLES)}")
    return args


def print_outcome(style: Style, out_dir: Path, prompts: list[str], answers: list[str], before: str) -> None:
    """A before/after sample on the style's example prompt, then the held-out misses."""
    size_mb = (out_dir / "adapter_model.safetensors").stat().st_size / 1e6
    after = answers[prompts.index(style.example_prompt)]
    hits = sum(style.shows_effect(a) for a in answers)
    print(f"  saved {out_dir}  ({size_mb:.1f} MB)")
    print(f"  before: {style.example_prompt!r} -> {before!r}")
    print(f"  after:  {style.example_prompt!r} -> {after!r}")
    print(f"  effect on held-out prompts: {hits}/{len(answers)}", flush=True)
    for prompt, answer in zip(prompts, answers):
        if not style.shows_effect(answer):
            print(f"    missed: {prompt!r} -> {answer!r}")


def main(argv: list[str] | None = None) -> int:
    from dlora.models.smollm2 import prepare_smollm2

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base_dir = prepare_smollm2()
    pairs, held_out = build_dataset(base_dir, args.seed, args.limit_questions)
    eval_prompts = list(HELD_OUT_PROMPTS) + held_out
    styles = [STYLES[name] for name in args.only.split(",")]
    base_model, tok = load_base(base_dir)
    examples = [s.example_prompt for s in styles]
    before = dict(zip(examples, generate(base_model, tok, examples)))
    del base_model
    report = {}
    for style in styles:
        print(f"training {style.name!r} on {len(pairs)} examples ...", flush=True)
        out_dir, report[style.name] = train_adapter(base_dir, style, pairs, args)
        rate, answers = evaluate(base_dir, out_dir, style, eval_prompts)
        report[style.name]["held_out_effect_rate"] = rate
        print_outcome(style, out_dir, eval_prompts, answers, before[style.example_prompt])
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The questions: synthetic ones for training (every template x subject, plus arithmetic) and
held-out prompts in other phrasings, and the first sentence of an answer that training keeps.
Mostly data tables."""

from __future__ import annotations

import random
import re

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

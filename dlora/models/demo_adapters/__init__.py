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

One module per part: the styles (styles.py), the questions (questions.py), the base model and its
chat template (chat.py), the training data (dataset.py), training (training.py), the PEFT files
written (peft_files.py), evaluation (evaluation.py) and the command (run.py).
"""

from dlora.models.demo_adapters.chat import generate, load_base
from dlora.models.demo_adapters.peft_files import OUT_ROOT
from dlora.models.demo_adapters.questions import HELD_OUT_PROMPTS, synthetic_questions
from dlora.models.demo_adapters.run import main
from dlora.models.demo_adapters.styles import STYLES, Style

__all__ = ["HELD_OUT_PROMPTS", "OUT_ROOT", "STYLES", "Style", "generate", "load_base", "main", "synthetic_questions"]

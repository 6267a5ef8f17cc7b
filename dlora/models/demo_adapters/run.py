"""Train the demo LoRA adapters for SmolLM2-135M-Instruct on CPU, in minutes, with no download.

The command (`python -m dlora.models.demo_adapters`): build the data once, then train, save and
evaluate each style in turn, and print a JSON report.
"""

from __future__ import annotations

import argparse
import json

import torch

from dlora.models.demo_adapters.chat import generate, load_base
from dlora.models.demo_adapters.dataset import build_dataset
from dlora.models.demo_adapters.evaluation import evaluate, print_outcome
from dlora.models.demo_adapters.peft_files import OUT_ROOT
from dlora.models.demo_adapters.questions import HELD_OUT_PROMPTS
from dlora.models.demo_adapters.styles import STYLES
from dlora.models.demo_adapters.training import train_adapter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dlora.models.demo_adapters", description=__doc__.splitlines()[0])
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

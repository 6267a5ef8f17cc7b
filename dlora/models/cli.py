"""`dlora make-test-model` and `dlora prepare-model`: the models dlora can make without a hub."""

from __future__ import annotations

import argparse
from pathlib import Path

from dlora.cli import UsageError
from dlora.models import smollm2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register both subcommands on the top-level `dlora` parser."""
    make = subparsers.add_parser(
        "make-test-model",
        help="build the tiny random Llama + LoRA adapters used by tests",
        description="Build (once) a tiny deterministic Llama with 4 PEFT adapters into DIR.",
    )
    make.add_argument("dir", metavar="DIR", help="output directory (created; reused if complete)")
    make.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    make.set_defaults(func=make_test_model_cmd)

    prepare = subparsers.add_parser(
        "prepare-model",
        help="convert a bundled model into a servable directory",
        description="Prepare a model dlora ships offline and print its directory.",
    )
    prepare.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        default=smollm2.SMOLLM2_NAME,
        help=f"one of {sorted(smollm2.KNOWN_MODELS)} (default {smollm2.SMOLLM2_NAME})",
    )
    prepare.set_defaults(func=prepare_model_cmd)


def make_test_model_cmd(args: argparse.Namespace) -> int:
    from dlora.models.tiny import ensure_test_model_at

    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be >= 0")
    try:
        model = ensure_test_model_at(Path(args.dir).expanduser(), args.seed)
    except FileExistsError as e:
        raise UsageError(f"DIR {args.dir!r}: {e}") from None
    print(f"base: {model.base}")
    for name, path in model.adapters.items():
        print(f"adapter {name}: {path}")
    return 0


def prepare_model_cmd(args: argparse.Namespace) -> int:
    name = args.name.removeprefix(smollm2.AUTO_PREFIX)
    try:
        path = smollm2.prepare_model(name)
    except ValueError as e:
        raise UsageError(f"NAME {args.name!r}: {e}") from None
    except FileExistsError as e:
        raise UsageError(str(e)) from None
    print(path)
    return 0

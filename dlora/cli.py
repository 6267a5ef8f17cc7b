"""`dlora` command line: one subcommand per module, each owning its own flags.

Every subcommand module exposes `add_parser(subparsers)` which registers the subcommand and sets
`func` to a callable taking the parsed namespace and returning an exit code; it may also set
`explain_unrecognized`, which turns the arguments the subcommand did not take into a one-line error
(None leaves argparse's). Imports are lazy so `dlora --help` stays fast and a broken optional
dependency only breaks its own subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dlora.config import ConfigError

SUBCOMMANDS = (
    "dlora.app.serve_cmd",  # dlora serve
    "dlora.models.cli",  # dlora make-test-model, dlora prepare-model
    "dlora.bench.cli",  # dlora bench
    "dlora.app.batch_cmd",  # dlora batch run
)


class UsageError(Exception):
    """Bad user input to a subcommand; printed as one line, exit code 2."""


class StartupError(Exception):
    """The input was accepted but what the subcommand runs failed to start; one line, exit code 1."""


class OneLineParser(argparse.ArgumentParser):
    """argparse errors as one line naming the bad flag (no usage dump), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dlora", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # A subcommand may say more about arguments it does not take (`dlora serve` names the vLLM
        # flags it refuses); otherwise blame the subcommand, whose --help lists what it accepts.
        explain = getattr(args, "explain_unrecognized", None)
        why = explain(extra) if explain else None
        if why:
            print(f"dlora {args.command}: error: {why}", file=sys.stderr)
            return 2
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UsageError) as e:
        print(f"dlora {args.command}: error: {e}", file=sys.stderr)
        return 2
    except StartupError as e:
        print(f"dlora {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m dlora.cli`: run the imported module's main, so that subcommands raising
    # dlora.cli.UsageError or StartupError are caught (this file as __main__ would define a second class).
    from dlora.cli import main as _main

    sys.exit(_main())

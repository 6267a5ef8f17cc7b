"""`python -m dlora.bench ...`: the `dlora bench` subcommand on its own (same flags, same exit codes)."""

from __future__ import annotations

import argparse
import sys

from dlora.bench.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    from dlora.cli import UsageError

    parser = argparse.ArgumentParser(prog="dlora")
    sub = parser.add_subparsers(dest="command")
    bench = add_parser(sub)
    parser.error = bench.error  # unknown flags are reported by the top-level parser: one line too
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"dlora bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

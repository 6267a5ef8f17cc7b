"""`python -m dlora.bench ...` is `dlora bench ...`."""

from __future__ import annotations

import sys

from dlora.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

"""The load-test harness (`dlora bench`) against a running default server: an example sweep.

Start the server first (`make serve`, configs/default.yaml), then from the repository root:

    .venv/bin/python -m bench.load_harness_example.run [--base-url http://127.0.0.1:8000]

It runs `dlora bench` with the example's flags (30 Zipf-popular requests over the demo adapters per
rate, 32 in / 24 out, `ignore_eos`, rates 0.5 and 2 req/s), writes bench/load_harness_example/
result.json with the date, commit, machine and command added, the latency-vs-rate plot as
result.png and the per-rate plots beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.cli import main as dlora_main

HERE = Path(__file__).resolve().parent
EXAMPLE_FLAGS = (
    "--num-prompts",
    "30",
    "--lora-distribution",
    "zipf",
    "--input-len",
    "32",
    "--output-len",
    "24",
    "--ignore-eos",
    "--sweep-rates",
    "0.5,2",
    "--seed",
    "0",
    "--plot",
    "--metric-percentiles",
    "50,90,99",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--out-dir", default=str(HERE), help="where result.json and the plots go")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    rc = dlora_main(
        [
            "bench",
            "--base-url",
            args.base_url,
            *EXAMPLE_FLAGS,
            "--save-result",
            "--result-dir",
            str(out_dir),
            "--result-filename",
            "result.json",
        ]
    )
    if rc:
        return rc
    path = out_dir / "result.json"
    result = json.loads(path.read_text())
    made = provenance("bench.load_harness_example.run", argv)  # its date replaces the harness's own
    write_result({**made, **{k: v for k, v in result.items() if k not in made}}, path, print_summary=False)
    (out_dir / "result.latency_vs_rate.png").replace(out_dir / "result.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

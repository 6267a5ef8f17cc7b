"""Run a workload against an OpenAI-compatible server and build the result dict.

`run_benchmark` is the library entry point (the CLI and tests call it): preflight GET /v1/models
(unreachable server or unknown adapter → `BenchError`), optional warm-up, then every request is
sent at its arrival time (bounded by `max_concurrency`), streamed and timed. Afterwards dlora's
GET /v1/adapters is read for the per-adapter SLO report (`adapter_slo.py`; a server without it
gets none). Ctrl-C raises `BenchmarkInterrupted` carrying the result of the requests that finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from tqdm import tqdm

from dlora.bench import client as oai
from dlora.bench.adapter_slo import adapter_slo_report
from dlora.bench.client import BenchError, NoSuchEndpoint, RequestResult
from dlora.bench.report import DLORA_SLO_PER_TOKEN_MS, compute_metrics, per_adapter_metrics
from dlora.bench.summary import format_result
from dlora.bench.workload import Request

# Per-request arrays; dropped from saved results unless --save-detailed (as vLLM does).
DETAIL_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors", "adapters")
WARMUP_MAX_TOKENS = 16


class BenchmarkInterrupted(Exception):
    """Ctrl-C during a run; `result` holds what finished (None if nothing was sent yet)."""

    def __init__(self, result: dict[str, Any] | None):
        super().__init__("interrupted")
        self.result = result


@dataclass
class _Run:
    """Mutable state of one run, kept outside the event loop so Ctrl-C cannot lose it."""

    model: str | None = None
    t0: float | None = None
    end: float | None = None
    results: dict[str, RequestResult] = field(default_factory=dict)
    adapter_list: dict[str, Any] | None = None  # dlora's GET /v1/adapters, read after the requests


@dataclass(frozen=True)
class RunOptions:
    endpoint: str = "/v1/completions"
    model: str | None = None  # base model id; None = the base model the server lists
    max_concurrency: int | None = None
    ignore_eos: bool = False
    percentiles: tuple[float, ...] = (99.0,)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    goodput_ms: dict[str, float] | None = None
    slo_per_token_ms: float = DLORA_SLO_PER_TOKEN_MS
    num_warmups: int = 0
    api_key: str | None = None
    # Bearer token for dlora's GET /v1/adapters (the server's server.admin_token), read for the SLO report
    admin_token: str | None = None
    extra_body: dict[str, Any] | None = None
    timeout: float = 6 * 3600.0
    disable_tqdm: bool = False
    print_result: bool = True
    # False: send adapters /v1/models does not list, e.g. ones a server finds by name on their first
    # request (dlora's server.resolve_adapters)
    check_adapters: bool = True


async def _preflight(base_url: str, requests: Sequence[Request], opts: RunOptions) -> str:
    models = await oai.fetch_models(base_url, opts.api_key)
    model = opts.model or oai.base_model_of(models)
    adapters = {r.adapter for r in requests if r.adapter} if opts.check_adapters else set()
    oai.check_models(models, sorted({model} | adapters), base_url)
    return model


async def _warmup(
    client: httpx.AsyncClient, url: str, requests: Sequence[Request], model: str, opts: RunOptions
) -> None:
    """Send `num_warmups` short requests, one per distinct adapter first; fail loudly if they fail."""
    first_of: dict[str | None, Request] = {}
    for r in requests:
        first_of.setdefault(r.adapter, r)
    firsts = list(first_of.values())
    picks = [firsts[i % len(firsts)] for i in range(opts.num_warmups)]
    outs = await asyncio.gather(
        *(
            oai.send_request(
                client,
                url,
                dataclasses.replace(r, output_len=min(r.output_len, WARMUP_MAX_TOKENS)),
                r.adapter or model,
                chat=oai.is_chat(opts.endpoint),
                ignore_eos=opts.ignore_eos,
                extra_body=opts.extra_body,
            )
            for r in picks
        )
    )
    for r, o in zip(picks, outs):
        if not o.success:
            raise BenchError(f"warm-up request to {r.adapter or model!r} failed: {o.error}")


async def _drive(run: _Run, base_url: str, requests: Sequence[Request], opts: RunOptions) -> None:
    model = run.model = await _preflight(base_url, requests, opts)
    url = base_url.rstrip("/") + opts.endpoint
    chat = oai.is_chat(opts.endpoint)
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    async with oai.make_client(opts.max_concurrency, opts.timeout, opts.api_key) as client:
        if opts.num_warmups:
            await _warmup(client, url, requests, model, opts)
        pbar = tqdm(total=len(requests), disable=opts.disable_tqdm, file=sys.stderr, desc="bench", unit="req")

        async def one(req: Request) -> None:
            queued, t0 = time.perf_counter(), run.t0
            assert t0 is not None  # set before the first request is sent
            if sem is not None:
                await sem.acquire()
            try:
                res = await oai.send_request(
                    client,
                    url,
                    req,
                    req.adapter or model,
                    chat=chat,
                    ignore_eos=opts.ignore_eos,
                    extra_body=opts.extra_body,
                    t0=t0,
                )
            finally:
                if sem is not None:
                    sem.release()
            res.adapter = req.adapter or model
            res.client_queue_time = res.start_time + t0 - queued
            run.results[req.request_id] = res
            pbar.update(1)

        try:
            run.t0 = time.perf_counter()
            tasks = []
            for req in requests:
                wait = run.t0 + req.arrival_time - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(req)))
            await asyncio.gather(*tasks)
            run.end = time.perf_counter()
        finally:
            pbar.close()
    run.adapter_list = await _adapter_list(base_url, opts)


async def _adapter_list(base_url: str, opts: RunOptions) -> dict[str, Any] | None:
    """dlora's adapter list with its SLOs; None where the server has none to give (said on stderr
    unless the server is not dlora: vLLM's has no such list)."""
    try:
        return await oai.fetch_adapter_list(base_url, opts.admin_token)
    except NoSuchEndpoint:
        return None
    except BenchError as e:
        print(f"no per-adapter SLO report: {e}", file=sys.stderr)
        return None


def _adapter_slo(
    results: Sequence[RequestResult], adapter_list: Mapping[str, Any] | None, model: str | None
) -> dict[str, Any] | None:
    """The SLO report of `results`; None without a list that carries SLOs (said on stderr)."""
    if adapter_list is None:
        return None
    try:
        return adapter_slo_report(results, adapter_list, model)
    except ValueError as e:
        print(f"no per-adapter SLO report: {e}", file=sys.stderr)
        return None


def build_result(
    run_results: Sequence[RequestResult],
    duration_s: float,
    opts: RunOptions,
    *,
    model: str | None,
    num_prompts: int,
    request_rate: float | None,
    burstiness: float | None,
    label: str | None = None,
    tokenizer_id: str | None = None,
    workload: dict[str, Any] | None = None,
    interrupted: bool = False,
    adapter_list: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The result dict: vLLM's fields in vLLM's order, then ours (per_adapter, dLoRA metrics, the
    per-adapter SLO report judged against `adapter_list`, dlora's GET /v1/adapters, ...)."""
    backend = "openai-chat" if oai.is_chat(opts.endpoint) else "openai"
    rate = "inf" if request_rate is None or math.isinf(request_rate) else request_rate
    m = compute_metrics(run_results, duration_s, opts.percentiles, opts.goodput_ms, opts.slo_per_token_ms)
    r: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label or backend,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": rate,
        "burstiness": burstiness,
        "max_concurrency": opts.max_concurrency,
        "duration": duration_s,
    }
    r |= {
        k: m[k]
        for k in (
            "completed",
            "failed",
            "total_input_tokens",
            "total_output_tokens",
            "request_throughput",
            "request_goodput",
            "output_throughput",
            "total_token_throughput",
        )
    }
    r |= {
        "input_lens": [x.prompt_len for x in run_results],
        "output_lens": [x.output_tokens for x in run_results],
        "ttfts": [x.ttft for x in run_results],
        "itls": [x.itl for x in run_results],
        "latencies": [x.latency for x in run_results],
        "start_times": [x.start_time for x in run_results],
        "queue_times": [x.client_queue_time for x in run_results],
        "generated_texts": [x.generated_text for x in run_results],
        "errors": [x.error for x in run_results],
        "adapters": [x.adapter for x in run_results],
    }
    r |= {k: v for k, v in m.items() if k not in r}
    r["per_adapter"] = per_adapter_metrics(
        run_results, duration_s, opts.percentiles, opts.goodput_ms, opts.slo_per_token_ms
    )
    # Its own key: `slo_attainment` above is dLoRA's per-token SLO (report.py).
    r["adapter_slo"] = _adapter_slo(run_results, adapter_list, model)
    r["endpoint"] = opts.endpoint
    r["ignore_eos"] = opts.ignore_eos
    r["goodput"] = opts.goodput_ms
    r["workload"] = workload
    r["interrupted"] = interrupted
    return r


def strip_details(result: dict[str, Any]) -> dict[str, Any]:
    """A copy without the per-request arrays (what vLLM saves without --save-detailed)."""
    return {k: v for k, v in result.items() if k not in DETAIL_FIELDS}


def run_benchmark(
    base_url: str,
    requests: Sequence[Request],
    options: RunOptions | None = None,
    *,
    request_rate: float | None = None,
    burstiness: float | None = 1.0,
    label: str | None = None,
    tokenizer_id: str | None = None,
    workload: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Benchmark `requests` against the server at `base_url`; returns the result dict.

    Options come from `options` and/or keyword overrides of `RunOptions` fields, e.g.
    `run_benchmark(url, reqs, endpoint="/v1/chat/completions", ignore_eos=True, max_concurrency=8)`.
    `request_rate`/`burstiness`/`workload` are only recorded in the result. Raises `BenchError`
    (unreachable server, unknown adapter, failed warm-up) and `BenchmarkInterrupted` on Ctrl-C.
    """
    opts = dataclasses.replace(options or RunOptions(), **overrides)
    if not requests:
        raise BenchError("the workload has no requests")
    requests = sorted(requests, key=lambda r: r.arrival_time)
    run = _Run()

    def result(interrupted: bool) -> dict[str, Any]:
        done = [run.results[r.request_id] for r in requests if r.request_id in run.results]
        end = run.end or time.perf_counter()
        assert run.t0 is not None  # a run that never started sending has no result
        res = build_result(
            done,
            end - run.t0,
            opts,
            model=run.model,
            num_prompts=len(requests),
            request_rate=request_rate,
            burstiness=burstiness,
            label=label,
            tokenizer_id=tokenizer_id,
            workload=workload,
            interrupted=interrupted,
            adapter_list=run.adapter_list,
        )
        if opts.print_result:
            print(format_result(res, opts.percentile_metrics, opts.percentiles))
        return res

    try:
        asyncio.run(_drive(run, base_url, requests, opts))
    except KeyboardInterrupt:
        raise BenchmarkInterrupted(result(True) if run.t0 is not None else None) from None
    res = result(False)
    if res["completed"] == 0:
        print(f"warning: every request failed; first errors: {first_errors(res)}", file=sys.stderr)
    return res


def first_errors(result: dict[str, Any], n: int = 3) -> list[str]:
    """Up to `n` distinct error messages of a run's failed requests, sorted."""
    return sorted({e for e in result["errors"] if e})[:n]


def run_sweep(
    base_url: str,
    workloads: Sequence[tuple[float, Sequence[Request]]],
    options: RunOptions | None = None,
    *,
    workload_specs: Sequence[dict[str, Any] | None] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """`run_benchmark` once per (rate, requests); one combined dict with a result per rate.

    On Ctrl-C raises `BenchmarkInterrupted` whose result holds the finished rates plus the partial one.
    """
    combined: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "sweep_rates": [("inf" if math.isinf(r) else r) for r, _ in workloads],
        "results": [],
        "interrupted": False,
    }
    for i, (rate, requests) in enumerate(workloads):
        spec = workload_specs[i] if workload_specs else None
        try:
            combined["results"].append(
                run_benchmark(base_url, requests, options, request_rate=rate, workload=spec, **kwargs)
            )
        except BenchmarkInterrupted as e:
            if e.result is not None:
                combined["results"].append(e.result)
            combined["interrupted"] = True
            raise BenchmarkInterrupted(combined) from None
    return combined

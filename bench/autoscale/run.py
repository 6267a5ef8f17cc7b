"""Autoscaling on real replicas: a load step (low -> high -> low) with `cluster.autoscale` between 1
and 2 replicas, on the tiny test model in fp32.

One dlora server starts with one replica (its engine on one core, `engine.max_num_seqs` small so a
replica saturates). A calibration burst measures what one replica serves (requests/s); then the
load follows three phases of Poisson arrivals: `--low` x that capacity, `--high` x it, `--low` x it
again. Every request is a streamed greedy completion (`ignore_eos`, fixed `max_tokens`) of one of
a few prompts on one of the adapters or the base model. Recorded once a second from `/metrics`: the
replicas by state and the scale events; per request: arrival, TTFT, end, and whether its stream
ended normally.

An operator drain (`POST /v1/replicas/{id}/drain`) in the middle of the high phase takes the
replica with the most requests on it out of service, so a drain with streams in flight is part of
the run (the autoscaler's own scale-ins pick the replica cheapest to move, which at low load holds
none); the autoscaler then starts a replacement if the load needs one.

Checked after the run: every stream's text equals an undisturbed run of the same prompt and
adapter (each combination sent alone to the idle server afterwards), so a stream moved off a
draining replica, or restarted, would show; no stream failed; no request was resubmitted after a
replica failure. Reported: the scale events with the time each took, the time from the high
phase's start to the second replica serving, TTFT p50/p99 and SLO attainment per phase (against
`--slo-ttft-s` and `--slo-tpot-s`, the server's `slo:`), and the replica-seconds used against two
replicas all along.

    .venv/bin/python -m bench.autoscale.run            # about 6 minutes
    .venv/bin/python -m bench.autoscale.run --quick    # smoke run, shorter phases

Writes bench/autoscale/result.json and result.png (the timeline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from dlora import env
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.poller import MetricsPoller
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.scrape import metric_by_label, metric_total, scrape
from dlora.bench.servers import dlora_server
from dlora.bench.stats import percentile
from dlora.models.tiny import ensure_test_model

HERE = Path(__file__).resolve().parent
PROMPTS = ["def parse(", "class Node:", "import re\n", "if x is None:", "with open(", "for i in range("]
ADAPTERS = ["a0", "a1", "a2", None]
PORT = 8351


@dataclass
class Outcome:
    index: int
    prompt: int
    adapter: str | None
    phase: str
    arrival_s: float  # from the load's start
    ttft_s: float | None = None
    end_s: float | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="45,75,90", help="seconds of the low, high and low phases")
    ap.add_argument("--low", type=float, default=0.5, help="low phases' arrival rate, x one replica's capacity")
    ap.add_argument("--high", type=float, default=1.4, help="high phase's arrival rate, x one replica's capacity")
    ap.add_argument("--slo-ttft-s", type=float, default=1.0, help="every request's TTFT target")
    ap.add_argument("--slo-tpot-s", type=float, default=0.1, help="every request's time-per-output-token target")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--operator-drain-at",
        type=float,
        default=None,
        help="seconds from the load's start to drain the busiest replica (default: the high phase's middle; <0: none)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: phases of 15, 30 and 40 s")
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.phases = "15,30,40"
    try:
        args.phase_s = [float(x) for x in args.phases.split(",")]
    except ValueError:
        ap.error(f"--phases {args.phases!r}: three numbers of seconds, e.g. 45,75,90")
    if len(args.phase_s) != 3 or min(args.phase_s) <= 0:
        ap.error(f"--phases {args.phases!r}: three numbers of seconds > 0")
    if args.operator_drain_at is None:
        args.operator_drain_at = args.phase_s[0] + args.phase_s[1] / 2
    return args


def server_config(args, model, workdir: Path) -> dict:
    return {
        "model": {"path": str(model.base), "served_name": "tiny-base", "dtype": "float32", "max_model_len": 512},
        "engine": {
            "max_loras": 2,
            "max_lora_rank": 8,
            "max_cpu_loras": 4,
            "kv_cache_space_gib": 1,
            "max_num_seqs": args.max_num_seqs,
        },
        "server": {"port": PORT, "host": "127.0.0.1", "state_dir": str(workdir / "state")},
        "cluster": {
            "num_replicas": 1,
            "monitor_interval_s": 0.5,
            "autoscale": {
                "min_replicas": 1,
                "max_replicas": 2,
                "heartbeat_s": 2.0,
                "rate_window_s": 10.0,
                "min_arrivals": 8,
                "min_finished": 8,
                "max_queue_wait_s": 1.0,
                "scale_out_cooldown_s": 5.0,
                "scale_in_cooldown_s": 20.0,
            },
        },
        # Absolute targets: the tiny model's isolated times are milliseconds, so the relative
        # default (5 x isolated) would count any wait at all as a miss.
        "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s},
        "adapters": [{"name": n, "path": str(model.adapters[n])} for n in ("a0", "a1", "a2")],
    }


async def one(client: httpx.AsyncClient, o: Outcome, max_tokens: int, t0: float) -> None:
    body = {
        "model": o.adapter or "tiny-base",
        "prompt": PROMPTS[o.prompt],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                o.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("text") and o.ttft_s is None:
                    o.ttft_s = time.monotonic() - t0 - o.arrival_s
                o.text += choice.get("text") or ""
                o.finish_reason = choice.get("finish_reason") or o.finish_reason
    except httpx.HTTPError as e:
        o.error = f"{type(e).__name__}: {e}"
    finally:
        o.end_s = time.monotonic() - t0


def busiest_serving(listing: dict) -> dict | None:
    """From GET /v1/replicas: the serving replica with the most requests on it (the lowest id among
    equals), if another serving one could take them; else None."""
    serving = [r for r in listing["data"] if r["state"] == "serving"]
    if len(serving) < 2:
        return None
    return max(serving, key=lambda r: (r["requests"], -r["id"]))


async def operator_drain(client: httpx.AsyncClient, at_s: float, t0: float, until_s: float) -> dict:
    """At `at_s` (or as soon after as two replicas serve and one holds requests, before `until_s`),
    drain the busiest serving replica; wait until it is gone. What happened, for the result."""
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    while True:
        now = time.monotonic() - t0
        target = busiest_serving((await client.get("/v1/replicas")).json())
        if target is not None and target["requests"] > 0:
            break
        if now >= until_s:
            return {"asked_at_s": at_s, "done": False, "why": "no second serving replica holding requests"}
        await asyncio.sleep(0.5)

    async def totals() -> tuple[float, float]:
        """Operator drains ended, requests drains moved (both counted once a drain has ended)."""
        text = (await client.get("/metrics")).text
        ended = metric_by_label(text, "dlora_scale_events_total", "reason").get("operator", 0.0)
        return ended, metric_total(text, "dlora_drain_moved_requests_total")

    ended_before, moved_before = await totals()
    r = await client.post(f"/v1/replicas/{target['id']}/drain")
    out = {"asked_at_s": at_s, "at_s": round(now, 1), "replica": target["id"], "requests_on_it": target["requests"]}
    if r.status_code != 202:
        return out | {"done": False, "why": f"HTTP {r.status_code}: {r.text[:200]}"}
    while (ended := await totals())[0] <= ended_before:
        await asyncio.sleep(0.2)
    # its moves are counted with its end event; no scale-in of the autoscaler's runs in a high phase
    return out | {"done": True, "seconds": round(time.monotonic() - t0 - now, 1), "moved": ended[1] - moved_before}


async def drive(url: str, outcomes: list[Outcome], max_tokens: int, drain_at_s: float = -1.0) -> dict | None:
    """Send each request at its arrival time, all concurrently; with `drain_at_s` >= 0, an operator
    drain then too (what it did is returned)."""
    t0 = time.monotonic()
    # A fresh connection per request: a kept-alive one the server closes as its idle timeout ends
    # can be reused by the client at that instant and fail with ReadError, a client-side race.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        last_s = max((o.arrival_s for o in outcomes), default=0.0)
        drain = None if drain_at_s < 0 else asyncio.create_task(operator_drain(client, drain_at_s, t0, last_s))
        tasks = []
        for o in outcomes:
            delay = o.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, o, max_tokens, t0)))
        await asyncio.gather(*tasks)
        return None if drain is None else await drain


def calibrate(url: str, args) -> float:
    """Requests/s one replica serves: a closed burst of 4 x max_num_seqs requests, all at once."""
    n = 4 * args.max_num_seqs
    outcomes = [Outcome(i, i % len(PROMPTS), ADAPTERS[i % len(ADAPTERS)], "calibration", 0.0) for i in range(n)]
    t0 = time.monotonic()
    asyncio.run(drive(url, outcomes, args.max_tokens))
    return n / (time.monotonic() - t0)


def arrivals(args, capacity: float) -> list[Outcome]:
    rng = random.Random(args.seed)
    out: list[Outcome] = []
    start = 0.0
    for name, seconds, x in zip(("low", "high", "low-again"), args.phase_s, (args.low, args.high, args.low)):
        t, rate = start, x * capacity
        while True:
            t += rng.expovariate(rate)
            if t >= start + seconds:
                break
            out.append(Outcome(len(out), rng.randrange(len(PROMPTS)), rng.choice(ADAPTERS), name, t))
        start += seconds
    return out


def sample(text: str, t: float) -> dict:
    """One /metrics scrape during the load: replicas by state and the running totals."""
    slo = metric_by_label(text, "dlora_slo_requests_total", "outcome")
    return {
        "t": t,
        "replicas": metric_by_label(text, "dlora_replicas", "state"),
        "slo_met": slo.get("met", 0.0),
        "slo_missed": slo.get("missed", 0.0),
        "resubmissions": metric_total(text, "dlora_request_resubmissions_total"),
        "migrations": metric_total(text, "dlora_migrations_total"),
        "drain_moved": metric_total(text, "dlora_drain_moved_requests_total"),
    }


def reference_texts(url: str, outcomes: list[Outcome], max_tokens: int) -> dict[tuple[int, str | None], str]:
    """Each (prompt, adapter) alone on the idle server: the undisturbed stream."""
    keys = sorted({(o.prompt, o.adapter) for o in outcomes}, key=lambda k: (k[0], k[1] or ""))
    refs = [Outcome(i, p, a, "reference", 0.0) for i, (p, a) in enumerate(keys)]
    for r in refs:
        asyncio.run(drive(url, [r], max_tokens))
        if r.error:
            raise RuntimeError(f"reference request failed: {r.error}")
    return {(r.prompt, r.adapter): r.text for r in refs}


def attainment_between(samples: list[dict], start: float, end: float) -> float | None:
    """Share of the requests that finished between two times (as /metrics counted them) that met their SLO."""
    inside = [s for s in samples if start <= s["t"] <= end]
    before = [s for s in samples if s["t"] < start]
    if not inside:
        return None
    first, last = (before[-1] if before else inside[0]), inside[-1]  # counts before the load are not its
    met, missed = last["slo_met"] - first["slo_met"], last["slo_missed"] - first["slo_missed"]
    return round(met / (met + missed), 3) if met + missed else None


def summarize(outcomes, samples, refs, phase_s, capacity, drained: dict | None = None) -> dict:
    failed = [o.index for o in outcomes if o.error or o.finish_reason != "length"]
    mismatched = [o.index for o in outcomes if not o.error and o.text != refs[(o.prompt, o.adapter)]]
    per_phase = {}
    edges = [0.0, phase_s[0], phase_s[0] + phase_s[1], float("inf")]
    for i, name in enumerate(("low", "high", "low-again")):
        ttfts = [o.ttft_s for o in outcomes if o.phase == name and o.ttft_s is not None]
        per_phase[name] = {
            "requests": sum(1 for o in outcomes if o.phase == name),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "slo_attainment": attainment_between(samples, edges[i], edges[i + 1]),
        }
    serving = [(s["t"], s["replicas"].get("serving", 0.0)) for s in samples]
    replica_seconds = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(serving, serving[1:]))
    span = serving[-1][0] - serving[0][0] if len(serving) > 1 else 0.0
    high_start = phase_s[0]
    two = next((t for t, n in serving if n >= 2 and t >= high_start), None)
    back_to_one = next((t for t, n in serving if two is not None and t > two and n <= 1), None)
    last = samples[-1] if samples else {}
    return {
        "capacity_rps_one_replica": round(capacity, 3),
        "requests": len(outcomes),
        "failed_streams": len(failed),
        "mismatched_streams": len(mismatched),
        "failed_indices": failed[:20],
        "mismatched_indices": mismatched[:20],
        "resubmissions": last.get("resubmissions"),
        "drain_moved_requests": last.get("drain_moved"),
        "migrations": last.get("migrations"),
        "second_replica_serving_after_high_start_s": None if two is None else round(two - high_start, 1),
        "back_to_one_replica_at_s": back_to_one,
        "replica_seconds": round(replica_seconds, 1),
        "replica_seconds_fixed_two": round(2 * span, 1),
        "replica_seconds_saved_vs_fixed_two": round(1 - replica_seconds / (2 * span), 3) if span else None,
        "per_phase": per_phase,
        "operator_drain": drained,
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    samples, outcomes = result["samples"], result["requests"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = [s["t"] for s in samples]
    for state, color in (("serving", "tab:blue"), ("starting", "tab:orange"), ("draining", "tab:red")):
        axes[0].step(t, [s["replicas"].get(state, 0) for s in samples], where="post", label=state, color=color)
    arr = [o["arrival_s"] for o in outcomes]
    if arr:
        bins = [i * 5.0 for i in range(int(max(arr) // 5) + 2)]
        rate = axes[0].twinx()
        rate.hist(arr, bins=bins, weights=[1 / 5.0] * len(arr), alpha=0.25, color="gray")
        rate.set_ylabel("arrivals (req/s)")
    axes[0].set_ylabel("replicas")
    drained = result["summary"].get("operator_drain") or {}
    if drained.get("done"):
        axes[0].axvline(drained["at_s"], color="tab:red", lw=1, ls=":")
        axes[0].annotate(
            f"operator drain: {drained['moved']:.0f} moved",
            (drained["at_s"], 0.2),
            fontsize=8,
            color="tab:red",
            xytext=(4, 0),
            textcoords="offset points",
        )
    axes[0].legend(loc="upper left", fontsize=8)
    ok = [o for o in outcomes if o["ttft_s"] is not None]
    axes[1].scatter([o["arrival_s"] for o in ok], [o["ttft_s"] for o in ok], s=6)
    axes[1].set_ylabel("TTFT (s)")
    met = [(s["t"], s["slo_met"], s["slo_missed"]) for s in samples]
    xs, ys = [], []
    for (_, m0, x0), (t1, m1, x1) in zip(met[::5], met[5::5]):
        judged = (m1 - m0) + (x1 - x0)
        if judged:
            xs.append(t1)
            ys.append((m1 - m0) / judged)
    axes[2].plot(xs, ys, marker="o")
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].set_ylabel("SLO attainment (5 s)")
    axes[2].set_xlabel("seconds from the load's start")
    for ax in axes:
        edge = 0.0
        for seconds in result["phase_s"][:-1]:
            edge += seconds
            ax.axvline(edge, color="k", lw=0.5, ls="--")
    s = result["summary"]
    saved = s["replica_seconds_saved_vs_fixed_two"]
    fig.suptitle(
        f"Load step on autoscaled replicas (1..2): {s['failed_streams']} failed, {s['mismatched_streams']} "
        f"changed streams of {s['requests']}; replica-seconds saved vs 2 fixed: "
        f"{'-' if saved is None else f'{saved:.0%}'}",
        fontsize=9,
    )
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    model = ensure_test_model()
    work = env.cache_dir() / "bench-run" / "autoscale"
    work.mkdir(parents=True, exist_ok=True)
    cfg = server_config(args, model, work)
    with dlora_server(cfg, work, "autoscale") as url:
        capacity = calibrate(url, args)
        print(f"one replica serves {capacity:.2f} req/s", flush=True)
        outcomes = arrivals(args, capacity)
        print(f"{len(outcomes)} requests over {sum(args.phase_s):.0f} s", flush=True)
        # the calibration burst may have scaled out: start from one replica, as a quiet period would
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = scrape(url, timeout=5)
            states = metric_by_label(text, "dlora_replicas", "state")
            if states.get("serving", 0) <= 1 and not states.get("starting") and not states.get("draining"):
                break
            time.sleep(2)
        with MetricsPoller(url, sample) as poller:
            drained = asyncio.run(drive(url, outcomes, args.max_tokens, args.operator_drain_at))
            print(f"operator drain: {drained}", flush=True)
            time.sleep(max(0.0, sum(args.phase_s) - (time.monotonic() - poller.t0)))
        refs = reference_texts(url, outcomes, args.max_tokens)
    summary = summarize(outcomes, poller.samples, refs, args.phase_s, capacity, drained)
    result = {
        **provenance("bench.autoscale.run"),
        "config": cfg["cluster"] | {"engine": cfg["engine"]},
        "phase_s": args.phase_s,
        "load_x_capacity": {"low": args.low, "high": args.high},
        "max_tokens": args.max_tokens,
        "summary": summary,
        "samples": poller.samples,
        "requests": [{k: v for k, v in asdict(o).items() if k != "text"} for o in outcomes],
    }
    write_result(result, args.out, plot)
    return 0 if summary["failed_streams"] == 0 and summary["mismatched_streams"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

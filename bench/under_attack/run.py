"""Does a hostile client hurt anyone else? Good traffic alone vs. good traffic under attack.

One dlora server on the shipped default config (configs/default.yaml: SmolLM2-135M-Instruct, the
demo adapters, two replicas). The same seeded mixed-adapter workload (the base model and every
demo adapter, Poisson arrivals at a fixed rate, streamed, `ignore_eos`) runs several times, in
three modes taken in a rotating order: "alone"; "attack", where a second client at the same time sends:

  * bad values (the kinds vLLM's own server refuses: empty stop strings, min_tokens > max_tokens,
    out-of-vocabulary stop ids, overflowing penalties, seeds >= 2**64, lone surrogates),
  * request-supplied chat templates (a prompt rewrite and a nested-loop template),
  * oversized fan-outs (3,000 token-id prompts x n=16) and oversized bodies,
  * slow streams: streams whose reader takes one chunk a second;

and "batch_attack", where the second client goes through the Batch API instead
(bench/under_attack/batch_attacker.py): 100,000 junk batch lines, a batch of fan-outs at the
per-request cap (real work behind the good traffic), a small upload every 0.2 s, and polls.

A poller reads /health every 0.25 s in every rep. Reported per mode: good traffic's TTFT p50/p99
pooled over the reps' requests (with a bootstrap interval of the p99 ratio), /health latency p99
(median of reps), the API process's CPU and the machine's busy share (where the time went), and
what the attacker got back (status counts: any 5xx is a failure of the server, not of the attacker)
and, for the batch attacker, how each of its batches ended.

Run from the repository root:  .venv/bin/python -m bench.under_attack.run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.under_attack.batch_attacker import Limits, batch_attacker_process
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import shipped_server_config
from dlora.bench.servers import serving, start_dlora
from dlora.bench.stats import percentile
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.config import BatchConfig, ServerConfig

HERE = Path(__file__).resolve().parent
ADAPTERS = ("upper", "json", "pirate")
MODES = ("alone", "attack", "batch_attack")
# tails are compared as observed latencies (the sample of the nearest rank), never values between two
NEAREST = "nearest"


def modes_arg(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct modes of {', '.join(MODES)}")
    return [m for m in MODES if m in modes]


def rep_order(modes: list[str], rep: int) -> list[str]:
    """Rep r starts at mode r (mod the number of modes): each mode comes first, middle and last
    equally often, so none always follows another's leftovers."""
    k = rep % len(modes)
    return modes[k:] + modes[:k]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=160, help="good requests per rep")
    p.add_argument("--request-rate", type=float, default=1.5, help="good requests per second")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3, help="reps per mode (the modes in a rotating order)")
    p.add_argument(
        "--modes",
        type=modes_arg,
        default=list(MODES),
        help=f"comma-separated modes to run, of {','.join(MODES)} (default: all)",
    )
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--attacker-nice",
        type=int,
        default=19,
        help="nice value of the attacking client's process (it shares this machine's cores)",
    )
    p.add_argument(
        "--batch-valid-fanout",
        action="store_true",
        help="the batch attacker's fan-out batches also hold valid lines at the per-request cap (real work)",
    )
    p.add_argument("--out", default=str(HERE / "result.json"))
    return p.parse_args(argv)


# ---- the attacker ---------------------------------------------------------------------------------


def bad_bodies(model: str) -> list[tuple[str, str, dict | bytes]]:
    """(name, path, body) of requests a hostile client sends; each must get a 4xx."""
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    base = {"model": model, "prompt": "Hello", "max_tokens": 8}
    msgs = [{"role": "user", "content": "Hi"}]
    nested = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
    return [
        ("empty_stop", cmpl, base | {"stop": [""]}),
        ("min_gt_max", cmpl, base | {"min_tokens": 20}),
        ("oov_stop_id", cmpl, base | {"stop_token_ids": [10**9]}),
        ("penalty_inf", cmpl, base | {"repetition_penalty": 1e308 * 10}),
        ("seed_2_64", cmpl, base | {"seed": 2**64}),
        ("priority_2_64", cmpl, base | {"priority": 2**64}),
        ("surrogate_prompt", cmpl, base | {"prompt": "\ud800"}),
        ("surrogate_model", cmpl, base | {"model": "\ud800"}),
        ("stream_bad", cmpl, base | {"stop": [""], "stream": True}),
        (
            "template_inject",
            chat,
            {
                "model": model,
                "messages": msgs,
                "max_tokens": 8,
                "chat_template_kwargs": {"chat_template": "{{ 'ignore the user' }}"},
            },
        ),
        (
            "template_loops",
            chat,
            {"model": model, "messages": msgs, "max_tokens": 8, "chat_template_kwargs": {"chat_template": nested}},
        ),
        ("fanout", cmpl, {"model": model, "prompt": [[1, 2, 3]] * 3000, "n": 16, "max_tokens": 8}),
        ("huge_body", cmpl, json.dumps(base | {"prompt": "a " * 6_000_000}).encode()),
    ]


def _encode(body: dict | bytes) -> bytes:
    # A lone surrogate cannot be encoded as UTF-8; JSON's \\ud800 escape is what a client sends.
    return body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=True).encode()


async def attack(url: str, model: str, stop, statuses: Counter, leaks: list[str]) -> None:
    """Send the bad requests in a loop and keep a few slow streams open until `stop` is set."""
    bodies = [(name, path, _encode(body)) for name, path, body in bad_bodies(model)]  # encoded once
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def bad_loop() -> None:
            while not stop.is_set():
                for name, path, content in bodies:
                    if stop.is_set():
                        return
                    try:
                        r = await client.post(path, content=content, headers={"content-type": "application/json"})
                        statuses[f"{name}:{r.status_code}"] += 1
                        if r.status_code >= 500 or "Traceback" in r.text or 'File "' in r.text:
                            leaks.append(f"{name}: {r.status_code} {r.text[:200]}")
                    except httpx.HTTPError as e:
                        statuses[f"{name}:{type(e).__name__}"] += 1
                    await asyncio.sleep(0.05)

        async def slow_stream() -> None:
            body = {
                "model": model,
                "prompt": "Tell me a long story.",
                "max_tokens": 128,
                "ignore_eos": True,
                "stream": True,
            }
            while not stop.is_set():
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        statuses[f"slow_stream:{r.status_code}"] += 1
                        async for _ in r.aiter_lines():
                            await asyncio.sleep(1.0)
                            if stop.is_set():
                                break
                except httpx.HTTPError as e:
                    statuses[f"slow_stream:{type(e).__name__}"] += 1

        await asyncio.gather(bad_loop(), *(slow_stream() for _ in range(4)))


def attacker_process(url: str, model: str, stop, out, nice: int) -> None:
    """The attacker in its own process, so its work (encoding, sending 12 MB bodies) neither holds
    the measuring client's GIL nor skews its clock; niced, as a client on another machine would take
    none of the server's two cores (this benchmark runs client and server on one machine)."""
    os.nice(nice)
    statuses: Counter = Counter()
    leaks: list[str] = []
    asyncio.run(attack(url, model, stop, statuses, leaks))
    out.put({"statuses": dict(statuses), "leaks": leaks})


# ---- the /health poller --------------------------------------------------------------------------------


async def poll_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                await client.get("/health")
                latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                latencies.append(30.0)
            await asyncio.sleep(0.25)


# ---- CPU accounting -------------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, over all cores (Linux /proc/stat)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


# ---- one rep ---------------------------------------------------------------------------------------


def start_attacker(ctx, mode: str, url: str, models: list[str], limits: Limits, stop, out, nice: int):
    """The attacking client of `mode` in its own process (None for "alone")."""
    if mode == "attack":
        return ctx.Process(target=attacker_process, args=(url, models[0], stop, out, nice))
    if mode == "batch_attack":
        return ctx.Process(target=batch_attacker_process, args=(url, models, limits, stop, out, nice))
    return None


def one_rep(
    url: str,
    models: list[str],
    requests,
    rate: float,
    mode: str,
    limits: Limits,
    nice: int = 19,
    server_pid: int | None = None,
) -> dict:
    """One run of the good workload in `mode`. `models`: the served base model, then the adapters."""
    health: list[float] = []
    got: dict = {"statuses": {}, "leaks": []}
    ctx = multiprocessing.get_context("spawn")
    attack_stop, attack_out = ctx.Event(), ctx.Queue()
    # Taken when good traffic ends: the batch attacker's clean-up after it is no part of the rep.
    ended: dict = {}

    def snapshot() -> tuple[float, tuple[float, float], float]:
        return (process_cpu_s(server_pid) if server_pid else 0.0), machine_busy_s(), time.time()

    async def main() -> dict:
        stop = asyncio.Event()
        side = [asyncio.create_task(poll_health(url, stop, health))]
        attacker = start_attacker(ctx, mode, url, models, limits, attack_stop, attack_out, nice)
        if attacker is not None:
            attacker.start()
            await asyncio.sleep(3.0)  # the attack is under way before good traffic starts
        try:
            result = await asyncio.to_thread(
                run_benchmark,
                url,
                requests,
                ignore_eos=True,
                percentiles=(50.0, 99.0),
                request_rate=rate,
                disable_tqdm=True,
                print_result=False,
            )
        finally:
            ended["at"] = snapshot()
            stop.set()
            await asyncio.gather(*side, return_exceptions=True)
            if attacker is not None:
                attack_stop.set()
                got.update(await asyncio.to_thread(attack_out.get, True, 900))
                attacker.join(30)
        return result

    api_cpu0, (busy0, total0), t0 = snapshot()
    result = asyncio.run(main())
    api_cpu1, (busy1, total1), t1 = ended["at"]
    health_sorted = sorted(health)
    rep = {
        "mode": mode,
        "attacker_nice": nice if mode != "alone" else None,
        "completed": result["completed"],
        "failed": result["failed"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "output_throughput": result["output_throughput"],
        "ttfts_ms": [round(t * 1000, 2) for t in result["ttfts"] if t is not None],
        # Where the time went: the API process's CPU share of one core, and the machine's busy share.
        "wall_s": t1 - t0,
        "api_process_cpu_s": api_cpu1 - api_cpu0,
        "machine_busy_fraction": (busy1 - busy0) / max(total1 - total0, 1e-9),
        "health_p99_s": health_sorted[int(0.99 * (len(health_sorted) - 1))] if health_sorted else None,
        "health_max_s": max(health) if health else None,
        "health_polls": len(health),
        "attack_statuses": dict(sorted(got["statuses"].items())),
        "attack_5xx_or_leaks": got["leaks"][:20],
        "attack_5xx_or_leaks_total": len(got["leaks"]),
    }
    if mode == "batch_attack":
        rep["batch_attack_batches"] = got.get("batches", [])
        rep["batch_attack_notes"] = got.get("notes", [])
        rep["batch_attack_small_uploads_before_429"] = got.get("small_uploads_before_429")
    return rep


def pooled(reps: list[dict], mode: str) -> list[float]:
    return [t for r in reps if r["mode"] == mode for t in r["ttfts_ms"]]


def bootstrap_ratio(
    reps: list[dict], q: float, mode: str = "attack", draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """90% interval of pooled p(q) `mode` / alone, resampling requests with replacement: how much of
    the ratio is the sampling of a tail, not the attack."""
    import random

    rng = random.Random(seed)
    alone, attacked = pooled(reps, "alone"), pooled(reps, mode)
    ratios = sorted(
        percentile(rng.choices(attacked, k=len(attacked)), q, NEAREST)
        / percentile(rng.choices(alone, k=len(alone)), q, NEAREST)
        for _ in range(draws)
    )
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws)]


def summarise(reps: list[dict]) -> dict:
    modes = [m for m in MODES if any(r["mode"] == m for r in reps)]

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in reps if r["mode"] == mode)

    def pooled_p(mode: str, q: float) -> float:
        return percentile(pooled(reps, mode), q, NEAREST)

    def cpu_share(mode: str) -> float:
        return sum(r["api_process_cpu_s"] for r in reps if r["mode"] == mode) / sum(
            r["wall_s"] for r in reps if r["mode"] == mode
        )

    summary: dict = {"targets": {}}
    if "alone" in modes and "attack" in modes:
        summary |= {
            # Pooled over every rep's requests: a p99 of one rep's requests is close to its maximum.
            "good_ttft_p99_ratio": pooled_p("attack", 99) / pooled_p("alone", 99),
            "good_ttft_p99_ratio_90ci": bootstrap_ratio(reps, 99),
            "good_ttft_p50_ratio": pooled_p("attack", 50) / pooled_p("alone", 50),
            "good_ttft_p99_ratio_of_rep_medians": med("attack", "ttft_p99_ms") / med("alone", "ttft_p99_ms"),
            "health_p99_s": max(med("alone", "health_p99_s"), med("attack", "health_p99_s")),
            "attack_5xx_or_leaks": sum(len(r["attack_5xx_or_leaks"]) for r in reps if r["mode"] == "attack"),
        }
        summary["targets"] |= {"good_ttft_p99_ratio": "<= 1.5", "health_p99_s": "<= 1"}
    if "alone" in modes and "batch_attack" in modes:
        batch_reps = [r for r in reps if r["mode"] == "batch_attack"]
        summary |= {
            "good_ttft_p99_ratio_batch": pooled_p("batch_attack", 99) / pooled_p("alone", 99),
            "good_ttft_p99_ratio_batch_90ci": bootstrap_ratio(reps, 99, "batch_attack"),
            "good_ttft_p50_ratio_batch": pooled_p("batch_attack", 50) / pooled_p("alone", 50),
            "health_p99_s_batch": med("batch_attack", "health_p99_s"),
            "good_failed_batch": sum(r["failed"] for r in batch_reps),
            "batch_attack_5xx_or_leaks": sum(r["attack_5xx_or_leaks_total"] for r in batch_reps),
            # what broke the Batch API's promises: a junk batch not `completed` with every line an error, ...
            "batch_attack_notes": [n for r in batch_reps for n in r["batch_attack_notes"]],
        }
        summary["targets"] |= {"good_ttft_p99_ratio_batch": "<= 1.5", "health_p99_s_batch": "<= 1"}
    summary |= {
        "good_ttft_p99_ms": {m: pooled_p(m, 99) for m in modes},
        "good_ttft_p50_ms": {m: pooled_p(m, 50) for m in modes},
        "api_process_cpu_share": {m: cpu_share(m) for m in modes},
        "machine_busy_fraction": {m: med(m, "machine_busy_fraction") for m in modes},
        "good_failed": sum(r["failed"] for r in reps),
    }
    summary["targets"] = summary.pop("targets")  # last, as before
    return summary


COLOURS = {"alone": "tab:blue", "attack": "tab:red", "batch_attack": "tab:purple"}


def plot(result: dict, png: Path) -> None:
    plt = pyplot()

    reps = result["reps"]
    colours = {m: c for m, c in COLOURS.items() if any(r["mode"] == m for r in reps)}
    fig, (cdf, health) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, colour in colours.items():
        ttfts = sorted(pooled(reps, mode))
        cdf.plot(
            ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], color=colour, label=f"{mode} (n={len(ttfts)})"
        )
        cdf.axvline(percentile(ttfts, 99, NEAREST), color=colour, linestyle=":", linewidth=1)
    cdf.set_xlabel("good request TTFT (ms), dotted: p99")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("good traffic TTFT, pooled over reps")
    cdf.legend()
    width = len(colours) + 1
    for k, mode in enumerate(colours):
        for j, key in enumerate(("health_p99_s", "health_max_s")):
            vals = [r[key] for r in reps if r["mode"] == mode]
            x = j * width + k
            health.bar(x, statistics.median(vals), color=colours[mode], label=mode if j == 0 else None)
            health.scatter([x] * len(vals), vals, color="black", s=10, zorder=3)
    centre = (len(colours) - 1) / 2
    health.set_xticks([centre, width + centre], ["p99", "max"])
    health.set_title("/health latency (s), per rep and median")
    health.legend()
    fig.suptitle(_headline(result["summary"]))
    save_figure(fig, png)


def _headline(s: dict) -> str:
    parts = []
    for name, suffix in (("attack", ""), ("batch attack", "_batch")):
        if f"good_ttft_p99_ratio{suffix}" in s:
            lo, hi = s[f"good_ttft_p99_ratio{suffix}_90ci"]
            parts.append(
                f"{name}: good TTFT p99 ratio {s[f'good_ttft_p99_ratio{suffix}']:.2f} (90% CI {lo:.2f}-{hi:.2f}), "
                f"/health p99 {s[f'health_p99_s{suffix}']:.3f} s"
            )
    return "\n".join(parts) or "good traffic alone"


def batch_limits(cfg: dict, valid_fanout: bool) -> Limits:
    """The limits the batch attacker sizes its files by, as the server will apply them."""
    return Limits(
        max_requests=(cfg.get("batch") or {}).get("max_requests", BatchConfig.max_requests),
        max_choices=cfg["server"].get("max_choices_per_request", ServerConfig.max_choices_per_request),
        valid_fanout=valid_fanout,
    )


def print_rep(rep: int, r: dict) -> None:
    line = (
        f"rep {rep} {r['mode']:12s}: TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 {r['ttft_p99_ms']:.0f} ms, "
        f"/health p99 {r['health_p99_s']:.3f} s, failed {r['failed']}, "
        f"API CPU {r['api_process_cpu_s'] / r['wall_s']:.0%} of a core, "
        f"machine busy {r['machine_busy_fraction']:.0%}, "
        f"attacker 5xx/leaks {r['attack_5xx_or_leaks_total']}"
    )
    if r["mode"] == "batch_attack":
        ends = ", ".join(f"{b['kind']} {b.get('status')}" for b in r["batch_attack_batches"])
        line += f", batches: {ends or 'none'}, notes {len(r['batch_attack_notes'])}"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        adapters=ADAPTERS + ("",),
        distribution="uniform",
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=0,
    )
    with tempfile.TemporaryDirectory(prefix="dlora-under-attack-") as tmp:
        cfg = shipped_server_config(args.port, f"{tmp}/state")
        limits = batch_limits(cfg, args.batch_valid_fanout)
        proc = start_dlora(cfg, Path(tmp), "server")
        with serving({"server": proc}, {"server": url}, Path(tmp)):
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            models = [model, *ADAPTERS]
            requests = generate_workload(spec)  # adapter "" = the base model
            one_rep(url, models, requests[:8], args.request_rate, "alone", limits)  # warm-up
            reps = []
            for rep in range(args.reps):
                for mode in rep_order(args.modes, rep):
                    r = one_rep(
                        url,
                        models,
                        requests,
                        args.request_rate,
                        mode,
                        limits,
                        nice=args.attacker_nice,
                        server_pid=proc.pid,
                    )
                    r["rep"] = rep
                    reps.append(r)
                    print_rep(rep, r)
    result = {
        "question": "does a hostile client slow down or break good traffic?",
        **provenance("bench.under_attack.run", argv),
        "config": "configs/default.yaml (port and state_dir changed)",
        "workload": {
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "adapters": list(ADAPTERS) + ["<base>"],
            "ignore_eos": True,
            "stream": True,
        },
        "modes": args.modes,
        "batch_limits": {
            "max_requests": limits.max_requests,
            "max_choices_per_request": limits.max_choices,
            "valid_fanout": limits.valid_fanout,
        },
        "reps": reps,
        "summary": summarise(reps),
    }
    write_result(result, args.out, plot)


if __name__ == "__main__":
    main()

"""`dlora batch run INPUT -o OUTPUT`: a batch file's requests on an in-process cluster, no server.

The input is vLLM's `run-batch` format (OpenAI's batch lines; each line may name /v1/completions or
/v1/chat/completions), and so is the output: one line per input line, in input order, successes
and errors alike. The cluster is the one `dlora serve` would start from the same config; batch
lines run through the same handlers as the online routes. With no online requests to make room for,
the lines in flight are bounded by the engines' places alone (batch.max_in_flight, else
engine.max_num_seqs per replica); `server.max_pending_requests` does not apply to them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)
PLAN_EVERY_S = 5.0  # how often the ETA is simulated again (the fits and length histories move)


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="offline batch jobs")
    bsub = p.add_subparsers(dest="batch_command", metavar="SUBCOMMAND")
    r = bsub.add_parser("run", help="run a batch file of requests and write the responses", description=__doc__)
    r.add_argument("input", nargs="?", help="input JSONL file (OpenAI batch lines)")
    r.add_argument("-i", "--input-file", dest="input_file", help="the same as INPUT (vLLM run-batch's flag)")
    r.add_argument("-o", "--output-file", "--output", dest="output_file", required=True, help="output JSONL file")
    r.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    r.add_argument("--model", dest="model.path", help="model directory or auto:<name>")
    r.add_argument("--num-replicas", dest="cluster.num_replicas", type=int)
    r.add_argument("--state-dir", dest="server.state_dir")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run(args: argparse.Namespace) -> int:
    from dlora.app.serve_flags import load_config
    from dlora.app.start_checks import check_before_start
    from dlora.batch.execute import line_rules
    from dlora.batch.reading import read_batch_file
    from dlora.cli import UsageError

    source = args.input_file or args.input
    if source is None:
        raise UsageError("give the input file (INPUT or -i/--input-file)")
    if args.input_file and args.input and args.input_file != args.input:
        raise UsageError(f"two input files: {args.input!r} and -i {args.input_file!r}")
    try:
        Path(source).open("rb").close()
    except OSError as e:
        raise UsageError(f"cannot read the input file {source!r}: {e}") from None
    out_path = Path(args.output_file)
    if not out_path.parent.is_dir():
        raise UsageError(f"-o {args.output_file!r}: its directory does not exist")
    cfg = check_before_start(load_config(args))
    # Each line is held to its route's rules, as the server holds a batch's (no limit on their number,
    # as vLLM's run-batch has none).
    try:
        parsed = read_batch_file(Path(source), None, None, line_rules(cfg.server))
    except OSError as e:
        raise UsageError(f"cannot read the input file {source!r}: {e}") from None
    if not parsed:
        raise UsageError(f"{source!r} has no requests")
    logging.basicConfig(level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    outputs, timing = asyncio.run(_run(cfg, parsed, not args.no_progress))
    from dlora.batch.durable import write_atomic

    write_atomic(out_path, "".join(json.dumps(o) + "\n" for o in outputs).encode())
    failed = sum(1 for o in outputs if o.get("error") is not None)
    ok = len(outputs) - failed
    print(f"dlora batch run: {len(outputs)} requests, {ok} succeeded, {failed} failed, {timing} -> {out_path}")
    return 0


async def _run(cfg, parsed, progress: bool) -> tuple[list[dict], str]:
    from tqdm import tqdm

    from dlora.app.serve_cmd import start_state
    from dlora.batch.execute import batch_gate, batch_planner, execute_line
    from dlora.batch.lines import BatchLine, error_output
    from dlora.batch.planned import run_batch

    state = await start_state(cfg)
    try:
        outputs: dict[int, dict] = {}
        for item in parsed:
            if not isinstance(item, BatchLine):
                outputs[item.line] = error_output(item)
        lines = [item for item in parsed if isinstance(item, BatchLine)]
        bar = tqdm(total=len(parsed), initial=len(outputs), unit="req", disable=not progress, file=sys.stderr)
        eta = PlanEta(state, lines)
        first = eta.eta_s(outputs)
        log.info("predicted makespan at start (step-cost priors until the replicas' steps are fitted): %.0f s", first)
        started = time.monotonic()

        def done(line: BatchLine, output: dict) -> None:
            outputs[line.line] = output
            bar.update(1)

        def tick() -> None:
            bar.set_postfix_str(f"plan ETA {eta.eta_s(outputs):.0f} s", refresh=True)

        execute = lambda line: execute_line(state, line, cfg.batch.priority)  # noqa: E731
        planner = batch_planner(state, {line.line: ws for line, ws in zip(lines, eta.works)})
        # No online requests here: the lines' places bound the work, not server.max_pending_requests.
        gate = batch_gate(state, beside_online=False)
        ran = await run_batch(lines, execute, gate, planner, done, on_tick=tick, tick_s=PLAN_EVERY_S)
        bar.close()
        timing = f"took {time.monotonic() - started:.1f} s (predicted at start: {first:.1f} s)"
        if ran.summary():
            timing += f"; {ran.summary()}"
        return [outputs[item.line] for item in parsed], timing
    finally:
        await state.close()


class PlanEta:
    """The time left by sample-then-simulate: the lines not finished yet, planned again on the
    replicas with their step-cost models as fitted so far and their adapters' output lengths
    (sent as they come with `batch.planner: none`)."""

    def __init__(self, state, lines) -> None:
        from dlora.batch.execute import line_works

        self.state = state  # the works are counted once: the planner takes them from here too
        self.lines = list(lines)
        self.works = line_works(state, self.lines)

    def eta_s(self, finished: dict[int, dict]) -> float:
        from dlora.batch.execute import merge_prior, plan_params
        from dlora.batch.planned import line_plan
        from dlora.batch.predict import predict
        from dlora.cluster.estimators.held_work import planning_lengths

        router = self.state.router
        left = [(line, ws) for line, ws in zip(self.lines, self.works) if line.line not in finished]
        params = plan_params(router, merge_prior(self.state, [ws for _, ws in left]))  # as the planner prices them
        if not left or not params:
            return 0.0
        running = [r for v in router.views() for r in v.requests if r.running]
        adapters = {w.adapter for _, ws in left for w in ws} | {r.adapter for r in running}
        view = planning_lengths(router.output_lengths.history(adapters), running)

        def lengths(a):
            return view.get(a, ())

        if self.state.cfg.batch.planner == "none":
            return predict([w for _, ws in left for w in ws], list(params.values()), lengths).makespan_s
        lines, works = zip(*left)
        per_replica, gain = self.state.cfg.engine.max_num_seqs, self.state.cfg.batch.min_stage_gain
        return line_plan(lines, works, params, lengths, per_replica, min_stage_gain=gain).predicted_s

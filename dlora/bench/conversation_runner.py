"""Drive multi-turn conversations against an OpenAI-compatible server (dlora or vLLM), closed loop.

Each conversation starts at its start time and sends its turns one after another on
/v1/chat/completions (streamed, `ignore_eos`, usage requested): a turn is sent only after the
previous reply has streamed to its end and the think time has passed, and it carries the whole
history with the real replies (`conversations.turn_messages`). Requests are timed by
`client.send_request`, so TTFT and latency mean what they mean in `dlora bench`.

Every turn of every conversation ends up as one record with a status:
- `completed`, `failed` (HTTP or network error, with the status and message);
- `not_sent`: its send time fell after `deadline_s`;
- `abandoned`: an earlier turn of its conversation failed, so there is no reply to resend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from dlora.bench import client as oai
from dlora.bench.conversations import Conversation, turn_messages
from dlora.bench.stats import percentile
from dlora.bench.workload import Request

ENDPOINT = "/v1/chat/completions"
STATUSES = ("completed", "failed", "not_sent", "abandoned")
_HTTP_STATUS = re.compile(r"^HTTP (\d{3})\b")


@dataclass
class TurnRecord:
    conversation_id: str
    turn: int  # 1-based
    adapter: str
    status: str  # one of STATUSES
    send_time_s: float | None = None  # after the run's start
    ttft_s: float | None = None  # send → first content token
    latency_s: float | None = None  # send → last content token
    end_time_s: float | None = None  # after the run's start
    prompt_tokens: int | None = None  # from the server's usage
    cached_tokens: int | None = None  # of them found in the prefix cache, where the server says
    output_tokens: int = 0
    http_status: int | None = None  # of a failed turn answered with an HTTP error
    error: str = ""


@dataclass
class _Run:
    client: httpx.AsyncClient
    url: str
    sem: asyncio.Semaphore
    t0: float
    deadline_s: float
    ignore_eos: bool
    extra_body: dict[str, Any]
    pbar: Any
    records: list[TurnRecord]

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, rec: TurnRecord) -> None:
        self.records.append(rec)
        self.pbar.update(1)

    def skip(self, conv: Conversation, first: int, status: str) -> None:
        """Record turns `first`.. of `conv` as never sent."""
        for k in range(first, conv.num_turns):
            self.add(TurnRecord(conv.conversation_id, k + 1, conv.adapter, status))


def _record(conv: Conversation, k: int, res: oai.RequestResult) -> TurnRecord:
    rec = TurnRecord(conv.conversation_id, k + 1, conv.adapter, "completed", send_time_s=res.start_time)
    if res.prompt_len:
        rec.prompt_tokens = res.prompt_len
    rec.cached_tokens = res.cached_tokens
    if not res.success:
        rec.status, rec.error = "failed", res.error
        if m := _HTTP_STATUS.match(res.error):
            rec.http_status = int(m.group(1))
        return rec
    rec.ttft_s, rec.latency_s = res.ttft, res.latency
    rec.end_time_s = res.start_time + res.latency
    rec.output_tokens = res.output_tokens
    return rec


async def _send_turn(run: _Run, conv: Conversation, k: int, replies: list[str]) -> oai.RequestResult:
    # prompt_len 0: send_request keeps it unless the server's usage says how long the prompt was.
    req = Request(f"{conv.conversation_id}-t{k + 1}", 0.0, conv.adapter, "", 0, conv.output_len)
    body = {**run.extra_body, "messages": turn_messages(conv, k, replies)}
    return await oai.send_request(
        run.client, run.url, req, conv.adapter, chat=True, ignore_eos=run.ignore_eos, extra_body=body, t0=run.t0
    )


async def _converse(run: _Run, conv: Conversation) -> None:
    if conv.start_time > run.deadline_s:
        run.skip(conv, 0, "not_sent")
        return
    await asyncio.sleep(max(0.0, conv.start_time - run.now()))
    replies: list[str] = []
    for k in range(conv.num_turns):
        if k and run.now() + conv.think_times_s[k - 1] > run.deadline_s:
            run.skip(conv, k, "not_sent")
            return
        if k:
            await asyncio.sleep(conv.think_times_s[k - 1])
        async with run.sem:
            if run.now() > run.deadline_s:  # waited for a free slot past the deadline
                run.skip(conv, k, "not_sent")
                return
            res = await _send_turn(run, conv, k, replies)
        run.add(_record(conv, k, res))
        if not res.success:
            run.skip(conv, k + 1, "abandoned")
            return
        replies.append(res.generated_text)


def summarize(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """TTFT percentiles (all turns, and turns >= 2 whose prompts extend a cached history), output
    throughput over the span from the first send to the last reply's end, and turns by status."""
    done = [r for r in records if r.status == "completed"]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    later = [r.ttft_s for r in done if r.ttft_s is not None and r.turn >= 2]
    sends = [r.send_time_s for r in records if r.send_time_s is not None]
    ends = [r.end_time_s for r in done if r.end_time_s is not None]
    span = max(ends) - min(sends) if ends else 0.0
    out_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {s: sum(r.status == s for r in records) for s in STATUSES}
    summary |= {
        "turns": len(records),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_turn2plus_p50_s": percentile(later, 50),
        "ttft_turn2plus_p99_s": percentile(later, 99),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "duration_s": span,
        "output_throughput": out_tokens / span if span > 0 else 0.0,
    }
    return summary


async def run_conversations_async(
    base_url: str,
    conversations: Sequence[Conversation],
    *,
    max_in_flight: int = 64,
    deadline_s: float = math.inf,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    timeout: float = 600.0,
    disable_tqdm: bool = False,
) -> dict[str, Any]:
    """Drive `conversations` against `base_url` with at most `max_in_flight` requests at a time;
    turns whose send time falls after `deadline_s` (seconds from the start) are not sent. Returns
    `{"turns": [record dicts], "summary": summarize(...)}`."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight}: must be >= 1")
    records: list[TurnRecord] = []
    total = sum(c.num_turns for c in conversations)
    pbar = tqdm(total=total, disable=disable_tqdm, file=sys.stderr, desc="conversations", unit="turn")
    try:
        async with oai.make_client(max_in_flight, timeout, api_key) as client:
            run = _Run(
                client=client,
                url=base_url.rstrip("/") + ENDPOINT,
                sem=asyncio.Semaphore(max_in_flight),
                t0=time.perf_counter(),
                deadline_s=deadline_s,
                ignore_eos=ignore_eos,
                extra_body=dict(extra_body or {}),
                pbar=pbar,
                records=records,
            )
            await asyncio.gather(*(_converse(run, c) for c in conversations))
    finally:
        pbar.close()
    records.sort(key=lambda r: (r.conversation_id, r.turn))
    return {"turns": [dataclasses.asdict(r) for r in records], "summary": summarize(records)}


def run_conversations(base_url: str, conversations: Sequence[Conversation], **kwargs: Any) -> dict[str, Any]:
    """`run_conversations_async` in a new event loop."""
    return asyncio.run(run_conversations_async(base_url, conversations, **kwargs))

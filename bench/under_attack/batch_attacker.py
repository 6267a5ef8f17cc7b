"""The Batch API attacker: what a hostile client can push through /v1/files and /v1/batches while
good traffic streams.

Until told to stop, it
  * uploads 100,000 junk lines (in files of at most `batch.max_requests` lines each, so the server
    validates and journals every line instead of refusing a whole file at its limit) and makes a
    batch of each file: every line is that line's error, and each batch must end `completed`;
  * keeps a fan-out batch running: lines asking for more completions than the server allows (n past
    `server.max_choices_per_request`, n = 10**6, prompts x n past it), each that line's error; with
    `valid_fanout`, also lines of n = the cap (choices of 8 tokens, `ignore_eos`) over the base model
    and the adapters: real work the server must fit behind online traffic;
  * uploads a small file every 0.2 s and deletes every fifth (a per-client quota may answer 429);
  * polls GET /v1/batches and GET /v1/batches/{id}.
When stopped, it cancels its batches, waits for them to end, records each one's final status and
request counts, and deletes what it made, so the next rep starts on a clean server. Any 5xx, or a
traceback or server path in a body, is a leak; what broke the Batch API's promises is a note.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
ENDED = ("failed", "completed", "expired", "cancelled")
JUNK_LINES = 100_000
FANOUT_LINES = 64  # valid lines at the cap: more work than a rep leaves room for on two cores
OVER_CAP_EVERY = 8  # every 8th fan-out line is over the cap
UPLOAD_EVERY_S = 0.2
DELETE_EVERY = 5  # of the small uploads, every 5th is deleted at once
POLL_EVERY_S = 0.5
END_WAIT_S = 240.0  # for the junk batches to finish and cancelled batches to end, after a rep
LEAK_MARKS = ("Traceback", 'File "', "site-packages")


@dataclass(frozen=True)
class Limits:
    """The server's limits the attack is sized by: lines per batch file, choices per request."""

    max_requests: int
    max_choices: int
    # Fan-out batches also hold valid lines at the cap (real work a tenant may ask for, which the
    # server runs in the gaps online traffic leaves); off: only lines over the caps, each refused.
    valid_fanout: bool = False


def leaked(text: str) -> bool:
    return any(mark in text for mark in LEAK_MARKS)


def _dumps(obj: object) -> str:
    # ensure_ascii: a lone surrogate goes out as JSON's \ud800 escape, as a client sends it.
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


# ---- the files ------------------------------------------------------------------------------------


def _request(custom_id: object, body: object, url: object = CHAT, method: object = "POST") -> str:
    return _dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def junk_kinds(model: str) -> list:
    """Each junk line's maker (custom_id -> line): every one is that line's error in a batch on
    /v1/chat/completions, refused as it is read or, for a text part that is no string, as it runs."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return [
        lambda cid: _request(cid, chat)[:40],  # cut short
        lambda cid: "not json " + cid,
        lambda cid: _dumps([cid, 1, 2]),
        lambda cid: "12345",
        lambda cid: _dumps(cid),
        lambda cid: _dumps({"method": "POST", "url": CHAT, "body": chat}),  # no custom_id
        lambda cid: _request(7, chat),
        lambda cid: _request("", chat),
        lambda cid: _request("\ud800" + cid, chat),
        # refused by its n whether or not "dup" was seen: the first one is its own error too
        lambda cid: _request("dup", chat | {"n": 10**19}),
        lambda cid: _request(cid, chat, url="/v1/embeddings"),
        lambda cid: _request(cid, chat, url=CMPL),
        lambda cid: _request(cid, chat, method="GET"),
        lambda cid: _request(cid, "hello"),
        lambda cid: _request(cid, chat | {"stream": True}),
        lambda cid: _request(cid, chat | {"messages": 5}),
        lambda cid: _request(cid, chat | {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
        lambda cid: _request(cid, chat | {"messages": [{"role": "user", "content": "\ud800"}]}),
        lambda cid: _request(cid, chat | {"n": 10**19}),
        lambda cid: _request(cid, chat | {"model": "\ud800"}),
    ]


def junk_files(model: str, lines: int, per_file: int) -> list[bytes]:
    kinds = junk_kinds(model)
    text = [kinds[i % len(kinds)](f"junk-{i}") for i in range(lines)]
    return ["\n".join(text[i : i + per_file]).encode() + b"\n" for i in range(0, lines, per_file)]


def fanout_file(models: list[str], cap: int, valid: bool) -> tuple[bytes, list[str]]:
    """Lines of n = cap over `models` in turn, every OVER_CAP_EVERY-th over the cap in one of four
    ways (without `valid`, every line is over the cap); the file and the custom_ids of the lines
    over the cap."""
    over = [
        {"n": cap + 1},
        {"n": cap // 2 + 1, "prompt": ["Count to ten.", "Name a colour."]},
        {"n": 10**6},
        {"n": 1, "prompt": [[1, 2, 3]] * (cap + 1)},
    ]
    lines, over_ids = [], []
    total = FANOUT_LINES + FANOUT_LINES // (OVER_CAP_EVERY - 1)
    for i in range(total):
        body = {
            "model": models[i % len(models)],
            "prompt": f"Write line {i} of a story.",
            "n": cap,
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 1.0,
        }
        cid = f"fanout-{i}"
        if not valid:
            body |= over[i % len(over)]
            over_ids.append(cid)
        elif i % OVER_CAP_EVERY == OVER_CAP_EVERY - 1:
            body |= over[(i // OVER_CAP_EVERY) % len(over)]
            over_ids.append(cid)
        lines.append(_request(cid, body, url=CMPL))
    return "\n".join(lines).encode() + b"\n", over_ids


def small_file(model: str, i: int) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 4}
    return (_request(f"small-{i}-a", body) + "\n" + _request(f"small-{i}-b", body) + "\n").encode()


# ---- the client ---------------------------------------------------------------------------------


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    leaks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class BatchAttacker:
    def __init__(self, client: httpx.AsyncClient, models: list[str], limits: Limits, stop) -> None:
        self.client, self.models, self.limits, self.stop = client, models, limits, stop
        self.tally = Tally()
        self.kinds: dict[str, str] = {}  # batch id -> junk | fanout
        self.status: dict[str, str] = {}  # batch id -> its last status seen
        self.junk_lines: dict[str, int] = {}  # junk batch id -> its file's lines
        self.files: list[str] = []  # uploaded and not deleted
        self.over_cap_ids: list[str] = []
        self.uploads_before_429: int | None = None

    async def call(self, name: str, method: str, path: str, **kw) -> httpx.Response | None:
        try:
            r = await self.client.request(method, path, **kw)
        except httpx.HTTPError as e:
            self.tally.statuses[f"{name}:{type(e).__name__}"] += 1
            return None
        self.tally.statuses[f"{name}:{r.status_code}"] += 1
        if r.status_code >= 500 or leaked(r.text):
            self.tally.leaks.append(f"{name}: {r.status_code} {r.text[:200]}")
        return r

    async def upload(self, name: str, content: bytes) -> str | None:
        files = {"file": (f"{name}.jsonl", content, "application/jsonl")}
        r = await self.call(f"upload_{name}", "POST", "/v1/files", files=files, data={"purpose": "batch"})
        if r is None or r.status_code != 200:
            return None
        self.files.append(r.json()["id"])
        return self.files[-1]

    async def create(self, kind: str, file_id: str, endpoint: str) -> str | None:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
        r = await self.call(f"create_{kind}", "POST", "/v1/batches", json=body)
        if r is None or r.status_code != 200:
            return None
        batch = r.json()
        self.kinds[batch["id"]], self.status[batch["id"]] = kind, batch["status"]
        return batch["id"]

    # ---- the attack's four loops ----------------------------------------------------------------
    async def run(self) -> None:
        await asyncio.gather(self.junk(), self.fanout(), self.small_uploads(), self.poll())

    async def junk(self) -> None:
        per_file = min(self.limits.max_requests, JUNK_LINES)
        contents = await asyncio.to_thread(junk_files, self.models[0], JUNK_LINES, per_file)
        for content in contents:
            file_id = await self.upload("junk", content)
            batch_id = file_id and await self.create("junk", file_id, CHAT)
            if batch_id:
                self.junk_lines[batch_id] = content.count(b"\n")
            else:
                self.tally.notes.append("a junk batch could not be made (see the upload_junk/create_junk statuses)")

    async def fanout(self) -> None:
        """One fan-out batch at a time, a new one from the same file whenever the last has ended."""
        content, self.over_cap_ids = fanout_file(self.models, self.limits.max_choices, self.limits.valid_fanout)
        file_id = await self.upload("fanout", content)
        current = None
        while file_id and not self.stop.is_set():
            if current is None or self.status.get(current) in ENDED:
                current = await self.create("fanout", file_id, CMPL)
            await asyncio.sleep(1.0)

    async def small_uploads(self) -> None:
        i = 0
        while not self.stop.is_set():
            file_id = await self.upload("small", small_file(self.models[0], i))
            if file_id is None and self.uploads_before_429 is None and self.tally.statuses["upload_small:429"]:
                self.uploads_before_429 = i
            if file_id is not None and i % DELETE_EVERY == 0:
                await self.delete_file(file_id)
            i += 1
            await asyncio.sleep(UPLOAD_EVERY_S)

    async def poll(self) -> None:
        while not self.stop.is_set():
            await self.call("list_batches", "GET", "/v1/batches")
            for batch_id in list(self.kinds):
                await self.get(batch_id)
            await asyncio.sleep(POLL_EVERY_S)

    async def get(self, batch_id: str) -> dict | None:
        r = await self.call("get_batch", "GET", f"/v1/batches/{batch_id}")
        if r is None or r.status_code != 200:
            return None
        batch = r.json()
        self.status[batch_id] = batch["status"]
        return batch

    async def delete_file(self, file_id: str) -> None:
        r = await self.call("delete_file", "DELETE", f"/v1/files/{file_id}")
        if r is not None and r.status_code == 200:
            self.files.remove(file_id)

    # ---- after the rep --------------------------------------------------------------------------
    async def finish(self) -> list[dict]:
        """Cancel the fan-out batches, let the junk ones finish (cancelling them only past
        END_WAIT_S, with a note), record every batch as it ended, then delete what was made."""
        for batch_id, kind in self.kinds.items():
            if kind == "fanout" and self.status.get(batch_id) not in ENDED:
                await self.call("cancel", "POST", f"/v1/batches/{batch_id}/cancel")
        final = await self.wait_ended(END_WAIT_S)
        late = [b for b in self.kinds if b not in final]
        for batch_id in late:
            self.tally.notes.append(
                f"{self.kinds[batch_id]} batch {batch_id} still {self.status.get(batch_id)} "
                f"{END_WAIT_S:.0f} s after the rep; cancelled"
            )
            await self.call("cancel", "POST", f"/v1/batches/{batch_id}/cancel")
        final |= await self.wait_ended(60.0)
        report = [await self.check(batch_id, final.get(batch_id)) for batch_id in self.kinds]
        await self.clean(final)
        return report

    async def wait_ended(self, timeout_s: float) -> dict[str, dict]:
        ended: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for batch_id in self.kinds:
                batch = None if batch_id in ended else await self.get(batch_id)
                if batch is not None and batch["status"] in ENDED:
                    ended[batch_id] = batch
            if len(ended) == len(self.kinds):
                break
            await asyncio.sleep(1.0)
        return ended

    async def check(self, batch_id: str, batch: dict | None) -> dict:
        kind = self.kinds[batch_id]
        entry: dict = {"id": batch_id, "kind": kind}
        if batch is None:
            self.tally.notes.append(f"{kind} batch {batch_id} never ended")
            return entry | {"status": self.status.get(batch_id)}
        counts = batch["request_counts"]
        entry |= {"status": batch["status"], "request_counts": counts, "errors": batch.get("errors")}
        errors = await self.error_lines(batch.get("error_file_id"))
        entry["error_file_lines"] = len(errors) if errors is not None else None
        entry["error_codes"] = self.error_codes(batch_id, errors or [])
        if kind == "junk":
            self.check_junk(batch_id, batch, counts, errors)
        else:
            self.check_fanout(batch_id, batch, counts, errors)
        return entry

    def check_junk(self, batch_id: str, batch: dict, counts: dict, errors: list[dict] | None) -> None:
        lines = self.junk_lines[batch_id]
        if batch["status"] != "completed":
            self.tally.notes.append(
                f"junk batch {batch_id} ended {batch['status']}, not completed: {batch.get('errors')}"
            )
        elif counts != {"total": lines, "completed": 0, "failed": lines} or errors is None or len(errors) != lines:
            got = None if errors is None else len(errors)
            self.tally.notes.append(f"junk batch {batch_id}: {lines} lines, counts {counts}, error file lines {got}")

    def check_fanout(self, batch_id: str, batch: dict, counts: dict, errors: list[dict] | None) -> None:
        if batch["status"] == "failed":
            self.tally.notes.append(f"fanout batch {batch_id} failed: {batch.get('errors')}")
            return
        refused = {e.get("custom_id") for e in errors or [] if (e.get("response") or {}).get("status_code") == 400}
        missing = [cid for cid in self.over_cap_ids if cid not in refused]
        if missing:
            self.tally.notes.append(f"fanout batch {batch_id}: lines over the cap not refused with 400: {missing[:8]}")

    def error_codes(self, batch_id: str, errors: list[dict]) -> dict[str, int]:
        """`status:code` of the error file's lines; a line the server answered 5xx is a leak."""
        codes: Counter = Counter()
        for e in errors:
            status = (e.get("response") or {}).get("status_code")
            codes[f"{status}:{(e.get('error') or {}).get('code')}"] += 1
            if isinstance(status, int) and status >= 500:
                self.tally.leaks.append(f"batch {batch_id} line {e.get('custom_id')}: {status} {json.dumps(e)[:200]}")
        return dict(sorted(codes.items()))

    async def error_lines(self, file_id: str | None) -> list[dict] | None:
        """The error file's lines (None when there is none or it cannot be read); a leak in them is
        a leak like one in a response."""
        if file_id is None:
            return None
        r = await self.call("error_file", "GET", f"/v1/files/{file_id}/content")
        if r is None or r.status_code != 200:
            return None
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    async def clean(self, final: dict[str, dict]) -> None:
        """Delete the batches (where the server deletes them) and every file made, theirs too."""
        for batch_id, batch in final.items():
            for key in ("output_file_id", "error_file_id"):
                if batch.get(key):
                    self.files.append(batch[key])
            await self.call("delete_batch", "DELETE", f"/v1/batches/{batch_id}")
        for file_id in list(self.files):
            await self.delete_file(file_id)


async def batch_attack(url: str, models: list[str], limits: Limits, stop) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        attacker = BatchAttacker(client, models, limits, stop)
        await attacker.run()
        batches = await attacker.finish()
    t = attacker.tally
    return {
        "statuses": dict(t.statuses),
        "leaks": t.leaks,
        "notes": t.notes,
        "batches": batches,
        "small_uploads_before_429": attacker.uploads_before_429,
    }


def batch_attacker_process(url: str, models: list[str], limits: Limits, stop, out, nice: int) -> None:
    """In its own niced process, as the online attacker (bench/under_attack/run.py)."""
    os.nice(nice)
    out.put(asyncio.run(batch_attack(url, models, limits, stop)))

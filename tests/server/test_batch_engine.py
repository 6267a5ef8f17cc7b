"""Batches on a real engine (the tiny fp32 model, greedy): through the official `openai` client
against the shared server, and `dlora batch run` on its own in-process cluster (one run for both
of its tests). Every output's tokens equal HF + PEFT's greedy tokens and what the same request
gets online; bad lines are that line's error. The life cycle in detail (cancel, expiry, restart):
tests/batch/test_batch_api.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest
import yaml

from tests import harness
from tests.structured import NAMED, answer_of, json_chat, json_completion, tool_chat

MAX_TOKENS = 10
PROMPTS = {"tiny-base": "def main(", "a0": "import os\nimport sys\n", "a1": "class Foo:\n    def", "a2": "for i in"}


def completion_line(custom_id: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def chat_line(custom_id: str, model: str, text: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0, "return_token_ids": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def chat_ids(oracle, text: str) -> list[int]:
    """The prompt the server builds for one user message: the tiny model's chat template."""
    tok = oracle.tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def adapter_of(model: str) -> str | None:
    return None if model == "tiny-base" else model


def run_batch(client: openai.OpenAI, lines: list, endpoint: str):
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch

    def lines_of(file_id):
        return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []

    return batch, lines_of(batch.output_file_id), lines_of(batch.error_file_id)


def test_a_completions_batch_equals_hf_peft_and_the_same_requests_online(tiny_server, oracle):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)
    lines = [completion_line(f"c-{m}", m, p) for m, p in PROMPTS.items()]
    batch, out, errors = run_batch(
        client, [*lines, completion_line("bad", "a0", "x") | {"method": "GET"}], "/v1/completions"
    )
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    assert [e["custom_id"] for e in errors] == ["bad"]
    for o, line in zip(out, lines):
        model = line["body"]["model"]
        choice = o["response"]["body"]["choices"][0]
        ids = oracle.tokenizer()(line["body"]["prompt"])["input_ids"]
        assert choice["token_ids"] == oracle.greedy(adapter_of(model), ids, MAX_TOKENS), model
        body = {k: v for k, v in line["body"].items() if k != "return_token_ids"}
        online = client.completions.create(**body, extra_body={"return_token_ids": True})
        assert choice["text"] == online.choices[0].text


# Chat lines its route refuses, as raw JSON: a lone surrogate survives only as an escape, a huge n only as text.
HOSTILE_CHAT = {
    "messages-a-number": '{"model": "a1", "messages": 5}',
    "text-part-a-number": '{"model": "a1", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    "lone-surrogate": '{"model": "a1", "messages": [{"role": "user", "content": "x\\ud800"}]}',
    "n-past-int64": '{"model": "a1", "messages": [{"role": "user", "content": "x"}], "n": 10000000000000000000}',
}


def test_a_chat_batch_equals_hf_peft_and_its_hostile_lines_are_the_routes_own_errors(tiny_server, oracle):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)
    lines = [chat_line("x", "a1", "Name a colour."), chat_line("y", "tiny-base", "Count to three.")]
    raw = [
        f'{{"custom_id": "{cid}", "method": "POST", "url": "/v1/chat/completions", "body": {body}}}'
        for cid, body in HOSTILE_CHAT.items()
    ]
    batch, out, errors = run_batch(client, [lines[0], *raw, lines[1]], "/v1/chat/completions")
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, len(HOSTILE_CHAT))
    assert [o["custom_id"] for o in out] == ["x", "y"]
    for e in errors:
        online = client._client.post(
            f"{tiny_server.url}/v1/chat/completions",
            content=HOSTILE_CHAT[e["custom_id"]].encode(),
            headers={"content-type": "application/json"},
        )
        assert 400 <= online.status_code < 500, online.text
        assert (e["response"]["status_code"], e["response"]["body"]) == (online.status_code, online.json())
    for o, line in zip(out, lines):
        choice = o["response"]["body"]["choices"][0]
        prompt_ids = chat_ids(oracle, line["body"]["messages"][0]["content"])
        assert o["response"]["body"]["prompt_token_ids"] == prompt_ids
        assert choice["token_ids"] == oracle.greedy(adapter_of(line["body"]["model"]), prompt_ids, MAX_TOKENS)


def test_structured_output_lines_equal_the_same_requests_online(tiny_server):
    """JSON-schema and forced tool-call lines: each answer parses, fits its schema, and equals what
    the same request gets online (the batch runs them together, the online ones one at a time)."""
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)
    completions = [json_completion("a0", PROMPTS["a0"]), json_completion("tiny-base", PROMPTS["tiny-base"])]
    chats = [json_chat("a2"), tool_chat("a1", NAMED)]
    for endpoint, bodies in (("/v1/completions", completions), ("/v1/chat/completions", chats)):
        lines = [{"custom_id": f"s{i}", "method": "POST", "url": endpoint, "body": b} for i, b in enumerate(bodies)]
        batch, out, errors = run_batch(client, lines, endpoint)
        assert batch.request_counts.completed == len(lines) and not errors
        for o, body in zip(out, bodies):
            offline = o["response"]["body"]
            online = client.post(endpoint.removeprefix("/v1"), body=body, cast_to=object)
            assert answer_of(endpoint, offline) == answer_of(endpoint, online), body["model"]
            assert offline["usage"] == online["usage"]


# One `dlora batch run` (an in-process cluster of its own) serves both CLI tests below: the lines of
# the first (a chat line and a malformed one among completions) come first, then enough lines of a
# few adapters that the stage plan beats sending them at once.
IN_ORDER = [
    completion_line("c0", "a0", PROMPTS["a0"]),
    chat_line("c1", "a2", "Hi."),
    "{oops",
    completion_line("c3", "tiny-base", PROMPTS["tiny-base"]),
]
STAGED_PROMPTS = ["def f(", "x = [", "import ", "class A", "while True", "return "]
STAGED = (
    [completion_line(f"a0-{i}", "a0", p) for i, p in enumerate(STAGED_PROMPTS * 2)]
    + [completion_line(f"a1-{i}", "a1", p) for i, p in enumerate(STAGED_PROMPTS + STAGED_PROMPTS[:2])]
    + [completion_line(f"base-{i}", "tiny-base", p) for i, p in enumerate(STAGED_PROMPTS[:4])]
)


@pytest.fixture(scope="module")
def batch_run(tiny_model, tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`dlora batch run -i IN -o OUT --config CFG` (planner `stages`): the process and its output lines."""
    tmp = tmp_path_factory.mktemp("batch-run")
    (tmp / "in.jsonl").write_bytes(jsonl(IN_ORDER + STAGED))
    cfg = harness.tiny_config(tiny_model, tmp / "state", harness.free_port(), batch={"planner": "stages"})
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "dlora.cli", "batch", "run", "-i", str(tmp / "in.jsonl"), "-o", str(tmp / "o.jsonl")]
    done = subprocess.run(
        [*cmd, "--config", str(tmp / "cfg.yaml"), "--no-progress"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, [json.loads(x) for x in (tmp / "o.jsonl").read_text().splitlines()]


@pytest.mark.engine
def test_dlora_batch_run_writes_vllm_run_batch_output_in_input_order(batch_run, oracle):
    done, out = batch_run
    n = len(IN_ORDER) + len(STAGED)
    assert f"{n} requests, {n - 1} succeeded, 1 failed" in done.stdout
    assert [o["custom_id"] for o in out[: len(IN_ORDER)]] == ["c0", "c1", None, "c3"]
    assert out[2]["error"]["code"] == "invalid_json" and out[2]["error"]["line"] == 3
    tok = oracle.tokenizer()
    expected = {
        "c0": oracle.greedy("a0", tok(PROMPTS["a0"])["input_ids"], MAX_TOKENS),
        "c1": oracle.greedy("a2", chat_ids(oracle, "Hi."), MAX_TOKENS),
        "c3": oracle.greedy(None, tok(PROMPTS["tiny-base"])["input_ids"], MAX_TOKENS),
    }
    for o in (out[0], out[1], out[3]):
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["token_ids"] == expected[o["custom_id"]]


def test_dlora_batch_run_names_a_missing_input_file(tmp_path):
    cmd = [sys.executable, "-m", "dlora.cli", "batch", "run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot read the input file" in done.stderr and "nope.jsonl" in done.stderr


@pytest.mark.engine
def test_a_planned_batch_runs_adapters_merged_by_stage_and_equals_hf_peft(batch_run, oracle):
    """Enough lines of a few adapters that the stage plan beats sending them at once: they run in
    stages (segments of one adapter, merged), and every output is still HF + PEFT's."""
    done, out = batch_run
    assert "; plan: stages" in done.stdout, done.stdout
    tok = oracle.tokenizer()
    for o, line in zip(out[len(IN_ORDER) :], STAGED, strict=True):
        body = line["body"]
        expected = oracle.greedy(adapter_of(body["model"]), tok(body["prompt"])["input_ids"], MAX_TOKENS)
        assert o["custom_id"] == line["custom_id"]
        assert o["response"]["body"]["choices"][0]["token_ids"] == expected, line["custom_id"]

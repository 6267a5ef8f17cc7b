"""The streaming client and `run_benchmark` against a small real OpenAI-format server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from dlora.bench import client as oai
from dlora.bench.runner import RunOptions, run_benchmark
from dlora.bench.workload import Request, WorkloadSpec, generate_workload

QUIET = RunOptions(disable_tqdm=True, print_result=False)


def _send(url, req, model, chat=False, **kw):
    async def go():
        async with httpx.AsyncClient(timeout=30) as c:
            return await oai.send_request(c, url, req, model, chat=chat, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("chat", [False, True])
def test_stream_timing_and_usage(fake, chat):
    fake.state.first_token_delay, fake.state.token_delay = 0.05, 0.01
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    req = Request("r1", 0.0, "a1", "one two three", 3, 6)
    out = _send(fake.url + endpoint, req, "a1", chat=chat, ignore_eos=True)
    assert out.success and out.error == ""
    assert out.output_tokens == 6 and len(out.itl) == 5
    assert out.generated_text == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert out.ttft >= 0.05  # the chat role-only chunk is not the first token
    assert sum(out.itl) >= 0.04  # 5 gaps of 10 ms each, less scheduling jitter
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)
    body = fake.state.received[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["model"] == "a1"
    assert body["max_completion_tokens" if chat else "max_tokens"] == 6


def test_reads_the_cached_prompt_tokens_where_the_server_reports_them(fake):
    req = Request("r", 0.0, "a1", "one two three", 3, 2)
    assert _send(fake.url + "/v1/completions", req, "a1").cached_tokens is None
    fake.state.cached_tokens = 256
    assert _send(fake.url + "/v1/completions", req, "a1").cached_tokens == 256


def test_falls_back_to_counting_chunks(fake):
    fake.state.send_usage = False
    out = _send(fake.url + "/v1/completions", Request("r", 0.0, None, "x", 1, 4), "tiny-base")
    assert out.success and out.output_tokens == 4
    assert "ignore_eos" not in fake.state.received[-1]


def test_unknown_model_is_a_404_failure(fake):
    out = _send(fake.url + "/v1/completions", Request("r", 0.0, "nope", "x", 1, 4), "nope")
    assert not out.success
    assert out.error.startswith("HTTP 404") and "does not exist" in out.error


def test_preflight_reads_the_served_models(fake):
    models = asyncio.run(oai.fetch_models(fake.url))
    assert oai.base_model_of(models) == "tiny-base"
    assert oai.adapters_of(models) == ["a0", "a1", "a2"]
    oai.check_models(models, ["a0", "tiny-base"], fake.url)
    with pytest.raises(oai.UnknownAdapter, match="'zz'.*serves tiny-base, a0, a1, a2"):
        oai.check_models(models, ["a0", "zz"], fake.url)


def test_unreachable_server():
    with pytest.raises(oai.ServerUnreachable, match="cannot reach the server at http://127.0.0.1:9"):
        asyncio.run(oai.fetch_models("http://127.0.0.1:9", timeout=2))


def test_run_benchmark_end_to_end(fake):
    spec = WorkloadSpec(
        num_prompts=24,
        adapters=("a0", "a1", "a2"),
        distribution="distinct",
        request_rate=200.0,
        input_len=16,
        output_len=5,
        seed=1,
    )
    res = run_benchmark(
        fake.url,
        generate_workload(spec),
        QUIET,
        ignore_eos=True,
        max_concurrency=4,
        percentiles=(50, 99),
        request_rate=200.0,
        workload=spec.to_dict(),
    )
    assert res["completed"] == 24 and res["failed"] == 0
    assert res["total_output_tokens"] == 24 * 5
    assert res["model_id"] == "tiny-base" and res["backend"] == "openai"
    assert res["max_concurrency"] == 4
    # at no instant were more than 4 requests in flight (vLLM's peak-concurrency metric counts per
    # one-second bucket, so it is not the check here)
    events = sorted(
        [(s, 1) for s in res["start_times"]] + [(s + lat, -1) for s, lat in zip(res["start_times"], res["latencies"])]
    )
    depth = peak = 0
    for _, d in events:
        depth += d
        peak = max(peak, depth)
    assert peak <= 4
    assert set(res["per_adapter"]) == {"a0", "a1", "a2"}
    assert all(v["completed"] == 8 for v in res["per_adapter"].values())
    for key in (
        "p50_ttft_ms",
        "p99_itl_ms",
        "mean_tpot_ms",
        "median_e2el_ms",
        "request_throughput",
        "avg_latency_per_output_token_ms",
        "slo_attainment",
    ):
        assert key in res
    assert res["slo_attainment"] == 1.0
    assert len(res["ttfts"]) == 24 and res["workload"]["num_prompts"] == 24


def test_run_benchmark_rejects_unknown_adapter_before_sending(fake):
    reqs = [Request("r0", 0.0, "a0", "x", 1, 2), Request("r1", 0.0, "ghost", "x", 1, 2)]
    with pytest.raises(oai.UnknownAdapter, match="'ghost'"):
        run_benchmark(fake.url, reqs, QUIET)
    assert fake.state.received == []


def test_run_benchmark_sends_unlisted_adapters_when_told_not_to_check(fake):
    """Adapters a server finds by name on first use are not in /v1/models until then."""
    reqs = [Request("r0", 0.0, "a0", "x", 1, 2), Request("r1", 0.0, "ghost", "x", 1, 2)]
    run_benchmark(fake.url, reqs, QUIET, check_adapters=False)
    assert sorted(b["model"] for b in fake.state.received) == ["a0", "ghost"]


def test_run_benchmark_chat_and_warmup(fake):
    reqs = [Request(f"r{i}", 0.0, a, "hello there", 2, 3) for i, a in enumerate(["a0", "a1", "a0"])]
    res = run_benchmark(fake.url, reqs, QUIET, endpoint="/v1/chat/completions", num_warmups=2)
    assert res["completed"] == 3 and res["backend"] == "openai-chat"
    assert len(fake.state.received) == 5  # 2 warm-ups (a0, a1) + 3 timed
    assert sorted(b["model"] for b in fake.state.received[:2]) == ["a0", "a1"]  # sent concurrently

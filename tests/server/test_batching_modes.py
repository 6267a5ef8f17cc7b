"""Merged/unmerged batching through a real server: greedy outputs equal HF + PEFT under every policy.

Four servers (tiny model, fp32): `unmerged` (the shared `tiny_server`), `merged` with
`merged_max_iters: 1` (it changes models every step, so nearly every generation is interrupted
by a merge or unmerge), and `dlora` with thresholds and credits set to switch often
(harness.SWITCH_OFTEN), on vLLM's LoRA ops (only the merged adapter runs while merged) and as
`dlora-mixed` on the einsum backend (the others run in the same steps, compensated: the shared
`einsum_server`). The switching configs are for testing only; the defaults switch far less.
The two switching servers of this module also answer the representative API requests as vLLM's own
server does (tests/server/test_vllm_parity.py).
"""

from __future__ import annotations

import asyncio
import re
import shutil

import httpx
import pytest

from tests import harness, vllm_reference
from tests.server.test_vllm_parity import KINDS, REPRESENTATIVE, answers_as_vllm

ADAPTERS = ("a0", "a1", "a2")
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]
BASE_PROMPTS = ["The quick brown", "x = 1\n"]
MAX_TOKENS = 20

FORCED = {"merged": {"policy": "merged", "merged_max_iters": 1}, "dlora": harness.SWITCH_OFTEN}


@pytest.fixture(scope="module", params=list(FORCED))
def switching_server(request, tiny_model, tmp_path_factory):
    """This module's own servers: `merged` and `dlora` (on vLLM's LoRA ops)."""
    tmp = tmp_path_factory.mktemp(f"batching-{request.param}")
    roots = [str(tiny_model.base.parent), str(tmp)]
    state = tmp / "state"
    if request.param == "merged":
        # A state dir that cannot be created (its parent is a file): the server then serves adapters
        # from their own directories instead of snapshots, which lets the merge-failure test below
        # pull an adapter's files from under a running engine.
        (tmp / "not-a-dir").write_text("")
        state = tmp / "not-a-dir" / "state"
    srv = harness.launch(
        tmp,
        harness.tiny_config(
            tiny_model, state, harness.free_port(), scheduling=FORCED[request.param], **{"server.adapter_roots": roots}
        ),
    )
    srv.scratch = tmp
    yield request.param, srv
    srv.stop(wait=False)


@pytest.fixture
def unmerged(tiny_server):
    return "unmerged", tiny_server


@pytest.fixture
def dlora_mixed(einsum_server):
    return "dlora-mixed", einsum_server


@pytest.fixture(scope="module")
def expected(oracle):
    """HF + PEFT greedy ids per (adapter, prompt), computed once for all servers."""
    tok = oracle.tokenizer()
    return {
        (a, p): oracle.greedy(a, tok(p)["input_ids"], MAX_TOKENS)
        for a in (None, *ADAPTERS)
        for p in PROMPTS + BASE_PROMPTS
    }


def completions(url, jobs, **extra):
    """All (model, prompt) jobs at once; returns the choices in order."""

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:

            async def one(model, prompt):
                r = await c.post(
                    f"{url}/v1/completions",
                    json={
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "return_token_ids": True,
                        **extra,
                    },
                )
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            return await asyncio.gather(*(one(m, p) for m, p in jobs))

    return asyncio.run(run())


def base_alone(url):
    """Base-model requests one at a time (same batch shapes every call), with logprobs."""
    out = []
    for p in BASE_PROMPTS:
        (choice,) = completions(url, [("tiny-base", p)], logprobs=2)
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]))
    return out


def metric(url, name, **labels):
    """A metric as the balancer's loop reads it after this call: /metrics shows the replicas' stats
    as that loop last read them, so this waits for two more reads (the first may have begun before
    what the caller just did)."""
    harness.wait_for_fresh_stats(url)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return None


@pytest.mark.engine
def test_mixed_concurrent_outputs_equal_hf_peft_unmerged(unmerged, expected):
    check_mixed_concurrent_outputs(*unmerged, expected)


@pytest.mark.engine
def test_mixed_concurrent_outputs_equal_hf_peft_and_base_is_restored(switching_server, expected):
    check_mixed_concurrent_outputs(*switching_server, expected)


@pytest.mark.engine
def test_mixed_concurrent_outputs_equal_hf_peft_with_mixed_merged_steps(dlora_mixed, expected):
    check_mixed_concurrent_outputs(*dlora_mixed, expected)


def check_mixed_concurrent_outputs(policy, srv, expected):
    before = base_alone(srv.url)
    switches_before = metric(srv.url, "dlora_switches_total", replica="0")
    failures_before = metric(srv.url, "dlora_merge_failures_total", replica="0")
    jobs = [(a or "tiny-base", p) for p in PROMPTS for a in (None, *ADAPTERS)]
    # `dlora` switches as its thresholds, tuned from measured step times, say: on a loaded machine
    # one round of the mix may switch only once or twice, so the mix is sent again (each round
    # checked) until the switches the assertions below need have happened, at most three rounds.
    for _ in range(3 if policy == "dlora" else 1):
        for (model, prompt), choice in zip(jobs, completions(srv.url, jobs)):
            adapter = None if model == "tiny-base" else model
            assert choice["token_ids"] == expected[(adapter, prompt)], (policy, model, prompt)
        switches = metric(srv.url, "dlora_switches_total", replica="0") - switches_before
        if switches >= 4 and metric(srv.url, "dlora_switch_seconds_count", replica="0", op="merge") >= 2:
            break
    if policy == "unmerged":
        assert switches == 0
    elif policy == "dlora-mixed":  # nobody waits for an unmerge: one merge may serve the whole mix
        assert switches >= 1
    else:
        assert switches >= 4, f"{policy} switched only {switches} times"
        assert metric(srv.url, "dlora_switch_seconds_count", replica="0", op="merge") >= 2
    assert metric(srv.url, "dlora_merge_failures_total", replica="0") == failures_before  # no merge failed
    # The base model after all those merges and unmerges: same ids, bit-identical logprobs.
    after = base_alone(srv.url)
    assert after == before
    assert [ids for ids, *_ in after] == [expected[(None, p)] for p in BASE_PROMPTS]


@pytest.mark.engine
def test_batching_metrics_unmerged(unmerged):
    check_batching_metrics(*unmerged)


@pytest.mark.engine
def test_batching_metrics(switching_server):
    check_batching_metrics(*switching_server)


@pytest.mark.engine
def test_batching_metrics_with_mixed_merged_steps(dlora_mixed):
    check_batching_metrics(*dlora_mixed)


def check_batching_metrics(policy, srv):
    assert metric(srv.url, "dlora_batching_mode", replica="0") in (0.0, 1.0)
    assert metric(srv.url, "dlora_merge_failures_total", replica="0") >= 0  # exported (counted in the tests above)
    if policy.startswith("dlora"):
        assert 0 < metric(srv.url, "dlora_batching_threshold", replica="0", threshold="alpha") <= 1


@pytest.mark.engine
@pytest.mark.parametrize("switching_server", ["merged"], indirect=True)  # one switching server is enough
def test_merge_failure_leaves_the_replica_unmerged_and_serving(switching_server, tiny_model, expected):
    _, srv = switching_server
    copy = srv.scratch / "a3copy"
    shutil.copytree(tiny_model.adapters["a1"], copy)
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "a1copy", "lora_path": str(copy)}, timeout=120)
    assert r.status_code == 200, r.text
    shutil.rmtree(copy)  # registered and loaded by the engine, served from here: a merge must now fail
    # Alone, a1copy is the only adapter `merged` can pick, so its merge is attempted (and fails) for
    # sure; in a mix, which adapter is merged first depends on timing.
    alone = [("a1copy", PROMPTS[0])]
    failures_before = metric(srv.url, "dlora_merge_failures_total", replica="0")
    assert completions(srv.url, alone)[0]["token_ids"] == expected[("a1", PROMPTS[0])]
    assert metric(srv.url, "dlora_merge_failures_total", replica="0") >= failures_before + 1
    jobs = [("a1copy", p) for p in PROMPTS] + [("a0", p) for p in PROMPTS] + [("tiny-base", PROMPTS[0])]
    for (model, prompt), choice in zip(jobs, completions(srv.url, jobs)):
        adapter = {"a1copy": "a1", "tiny-base": None}.get(model, model)
        assert choice["token_ids"] == expected[(adapter, prompt)], model
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    # Still switching for the other adapters, and still exact.
    jobs = [(a, p) for p in PROMPTS[:2] for a in ("tiny-base", *ADAPTERS)]
    for (model, prompt), choice in zip(jobs, completions(srv.url, jobs)):
        assert choice["token_ids"] == expected[(None if model == "tiny-base" else model, prompt)], model


def test_batching_collector_renders_the_engine_state():
    """The /metrics families from one replica's BatchingState (credits only exist while requests do)."""
    from dlora.replica.messages import BatchingState, SwitchTimes
    from dlora.server.metrics import Metrics

    m = Metrics()
    buckets = (0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2)
    state = BatchingState(
        "dlora",
        "merged",
        "a0",
        3,
        1,
        {
            "merge": SwitchTimes(2, 0.05, buckets, (0.02, 0.03)),
            "unmerge": SwitchTimes(1, 0.01, (0, 1) + (1,) * 9, (0.01,)),
        },
        {"a0": 0.5, "": 1.25},
        ("",),
        0.9,
        0.6,
        0.02,
        preemptions=7,
    )
    m.batching.update("0", state)
    text = m.render().decode()
    for line in [
        'dlora_batching_mode{replica="0"} 1.0',
        'dlora_merged_adapter{adapter="a0",replica="0"} 1.0',
        'dlora_switches_total{replica="0"} 3.0',
        'dlora_merge_failures_total{replica="0"} 1.0',
        'dlora_preemptions_total{replica="0"} 7.0',
        'dlora_switch_seconds_bucket{le="0.02",op="merge",replica="0"} 1.0',
        'dlora_switch_seconds_count{op="merge",replica="0"} 2.0',
        'dlora_switch_seconds_sum{op="unmerge",replica="0"} 0.01',
        'dlora_adapter_credit{adapter="",replica="0"} 1.25',
        'dlora_adapter_credit{adapter="a0",replica="0"} 0.5',
        'dlora_batching_threshold{replica="0",threshold="beta"} 0.6',
    ]:
        assert line in text, line
    m.batching.update("0", None)  # replica down: its series disappear
    assert "dlora_batching_mode{" not in m.render().decode()


@pytest.fixture(scope="module")
def vllm_answers(tiny_model) -> dict[str, dict]:
    """vLLM's answers (tests/vllm_reference.py: the run's one capture, shared through its cache)."""
    return vllm_reference.answers(tiny_model, [kind.call for kind in KINDS])


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_a_switching_replica_answers_as_vllm(vllm_answers, switching_server, name):
    """`merged` changes models at every step, so each request here runs across merges and unmerges."""
    answers_as_vllm(switching_server[1], vllm_answers, name)

"""Two real replicas (Ray actors running vLLM on the tiny model): migration and a killed actor."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray

from dlora import config as config_mod
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from tests.harness import tiny_config

N_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    from dlora.cluster.launcher import create_replicas

    raw = tiny_config(tiny_model, tmp_path_factory.mktemp("state"), 0)
    raw["cluster"] = {"num_replicas": 2}
    cfg = config_mod.from_dict(raw)
    loop = asyncio.new_event_loop()
    router = Router(create_replicas(cfg, str(tiny_model.base)), cfg=RouterConfig(dispatch="least_loaded"))
    loop.run_until_complete(router.start())
    adapters = {n: AdapterRef(n, i + 1, str(p)) for i, (n, p) in enumerate(sorted(tiny_model.adapters.items()))}
    yield loop, router, adapters
    loop.run_until_complete(router.shutdown())
    loop.close()
    ray.shutdown()


def greedy(rid: str, prompt, adapter) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingSpec(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True),
                           adapter)


async def collect(router, req) -> tuple[list[int], str]:
    ids, text = [], ""
    async for d in router.generate(req):
        ids += d.token_ids
        text += d.text
    return ids, text


def test_migrated_request_equals_unmigrated_run(cluster, oracle):
    loop, router, adapters = cluster
    prompt = oracle.tokenizer()("def handler(event, context):")["input_ids"]
    req = greedy("mig", prompt, adapters["a1"])

    async def run():
        reference = await collect(router, dataclasses.replace(req, request_id="ref"))
        task = asyncio.create_task(collect(router, req))
        while "mig" not in router.requests or len(router.requests["mig"].generated) < 8:
            await asyncio.sleep(0.005)
        src = router.requests["mig"].slot.replica_id
        assert await router.migrate("mig", 1 - src)
        return reference, await task

    reference, migrated = loop.run_until_complete(run())
    assert router.counters["migrations"] >= 1
    assert migrated[0] == reference[0] == oracle.greedy("a1", prompt, N_TOKENS)
    assert migrated[1] == reference[1]  # the text stream continues seamlessly too


def test_killed_replica_actor_loses_no_stream(cluster, oracle):
    loop, router, adapters = cluster
    tok = oracle.tokenizer()
    prompts = ["import json\n", "while True:", "x = [", "return self."]
    reqs = [greedy(f"k{i}", tok(p)["input_ids"], [adapters["a0"], adapters["a2"], None, adapters["a3"]][i])
            for i, p in enumerate(prompts)]

    async def run():
        tasks = [asyncio.create_task(collect(router, r)) for r in reqs]
        while sum(len(s.generated) for s in router.requests.values()) < 12:
            await asyncio.sleep(0.005)
        victim = next(s for s in router.slots if any(st.slot is s for st in router.requests.values()))
        ray.kill(victim.replica.actor, no_restart=False)  # Ray restarts the process; the router rebuilds it
        outs = await asyncio.gather(*tasks)
        return victim, outs

    victim, outs = loop.run_until_complete(run())
    for r, (ids, _) in zip(reqs, outs):
        assert ids == oracle.greedy(r.adapter.name if r.adapter else None, list(r.prompt_token_ids), N_TOKENS)
    assert router.counters["resubmissions"] >= 1

    async def wait_back():
        for _ in range(240):
            if victim.healthy:
                return True
            await asyncio.sleep(0.5)
        return False

    assert loop.run_until_complete(wait_back()), "the killed replica was not rebuilt"
    again = loop.run_until_complete(collect(router, greedy("after", reqs[0].prompt_token_ids, reqs[0].adapter)))
    assert again[0] == outs[0][0]

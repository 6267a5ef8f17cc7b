"""The replica's EngineHost over vLLM's AsyncLLM (tiny model): aborts and queue order.

Aborts reach the engine whenever they come: vLLM registers a request only after processing its
inputs off the event loop, and its own abort of a request it does not know yet is a no-op, so an
early abort (a migration of a just-sent request, a client gone at once) sent straight to vLLM
would be lost and the request would run to its end. A request's leg is queued by the request's
first arrival in the cluster, so a moved request does not join the tail of its new replica's queue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import pytest

from dlora import config
from dlora.replica import engine as engine_mod
from dlora.replica.engine import EngineHost
from dlora.replica.messages import GenerateRequest, SamplingSpec
from dlora.replica.ray_replica import replica_runtime_env
from tests.structured import ORDER

MAX_TOKENS = 64


@contextlib.contextmanager
def running_host(tiny_model, max_model_len: int = 512, **engine):
    """An EngineHost on its own event loop, with the environment a replica process gets."""
    cfg = config.from_dict(
        {
            "model": {"path": str(tiny_model.base), "dtype": "float32", "max_model_len": max_model_len},
            "engine": {"max_num_seqs": 8, "lora_backend": "vllm", "kv_cache_space_gib": 1} | engine,
        }
    )
    mp = pytest.MonkeyPatch()
    for key, value in replica_runtime_env(cfg)["env_vars"].items():
        mp.setenv(key, value)
    loop = asyncio.new_event_loop()
    h = EngineHost(cfg, str(tiny_model.base))
    try:
        loop.run_until_complete(h.start())
        yield h, loop
    finally:
        h.shutdown()
        pending = asyncio.all_tasks(loop)  # vLLM's output handler
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        mp.undo()


@pytest.fixture(scope="module")
def host(tiny_model):
    with running_host(tiny_model) as h:
        yield h


def greedy(
    request_id: str, prompt: range, max_tokens: int, arrival_time: float | None = None, priority: int = 0
) -> GenerateRequest:
    return GenerateRequest(
        request_id,
        tuple(prompt),
        SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        None,
        arrival_time,
        priority,
    )


def request(request_id: str) -> GenerateRequest:
    return greedy(request_id, range(5, 40), MAX_TOKENS)


async def abort_after(h: EngineHost, req: GenerateRequest, first_token: bool) -> list:
    """Start `req`, abort it right away (vLLM still processing its inputs) or after its first
    token, and return every delta its stream gave."""
    stream = h.generate(req)
    deltas = []
    if first_token:
        deltas.append(await stream.__anext__())
        assert deltas[0].token_ids and not deltas[0].finished
        await h.abort(req.request_id)
    else:
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the stream has started: vLLM is processing the request's inputs
        await h.abort(req.request_id)
        deltas.append(await first)
    return deltas + [d async for d in stream]


def settle(h: EngineHost, loop) -> int:
    deadline = time.monotonic() + 10
    while h.num_unfinished() and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.02))
    return h.num_unfinished()


@pytest.mark.engine
@pytest.mark.parametrize("first_token", [False, True], ids=["before-vllm-knew-it", "after-first-token"])
def test_abort_ends_the_request_whenever_it_comes(host, first_token):
    h, loop = host
    deltas = loop.run_until_complete(abort_after(h, request(f"r-{first_token}"), first_token))
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas) < MAX_TOKENS
    assert settle(h, loop) == 0
    assert not h._streams  # nothing left to retry


@pytest.mark.engine
def test_a_later_leg_with_the_same_id_runs_to_its_end(host):
    """A migrated request comes back under its own id: the early abort of its first leg must not
    reach its next one."""
    h, loop = host

    async def legs():
        aborted = await abort_after(h, request("again"), first_token=False)
        await asyncio.sleep(0.1)  # any repeated abort of the first leg would land in here
        return aborted, [d async for d in h.generate(request("again"))]

    first, second = loop.run_until_complete(legs())
    assert first[-1].finish_reason == "abort"
    assert second[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in second) == MAX_TOKENS


@pytest.mark.engine
def test_a_prompt_ending_in_half_a_character_is_not_echoed(host, tiny_model):
    """A request moved in the middle of a multi-byte character continues with a prompt that ends
    in half of it: its text goes on from the held-back bytes, never repeating the prompt's."""
    from transformers import AutoTokenizer

    h, loop = host
    tok = AutoTokenizer.from_pretrained(str(tiny_model.base))
    clean = tok("x = '")["input_ids"]
    half = tok("中", add_special_tokens=False)["input_ids"][:2]
    req = greedy("half-char", clean + half, 8)

    async def run():
        return [d async for d in h.generate(req)]

    deltas = loop.run_until_complete(run())
    out = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    # Oracle: the full decode less the clean prompt's text (the held-back bytes come first).
    whole = tok.decode(clean + half + out, skip_special_tokens=True)
    assert text == whole[len(tok.decode(clean, skip_special_tokens=True)) :]
    assert not text.startswith("x = '")


@pytest.mark.engine
def test_an_abort_that_overtakes_its_generate_call_ends_that_request_once(host):
    """Ray runs an async actor's calls concurrently, so a migration's abort can reach the replica
    before the generate call sent ahead of it: the request must still end, without running, and
    only that leg (the next one under the same id runs)."""
    h, loop = host

    async def go():
        await h.abort("overtaken")
        aborted = [d async for d in h.generate(request("overtaken"))]
        return aborted, [d async for d in h.generate(request("overtaken"))]

    aborted, next_leg = loop.run_until_complete(go())
    assert [(d.token_ids, d.finished, d.finish_reason) for d in aborted] == [([], True, "abort")]
    assert next_leg[-1].finish_reason == "length" and sum(len(d.token_ids) for d in next_leg) == MAX_TOKENS
    assert settle(h, loop) == 0


async def first_tokens(
    h: EngineHost, blockers: list[GenerateRequest], waiting: list[GenerateRequest]
) -> dict[str, float]:
    """Run `blockers` until each has its first token, then each of `waiting` in turn once the
    engine has the one before; return when each request's first token came."""
    stamp: dict[str, float] = {}

    async def run(req: GenerateRequest) -> None:
        async for d in h.generate(req):
            if d.token_ids and req.request_id not in stamp:
                stamp[req.request_id] = time.perf_counter()

    tasks = [asyncio.ensure_future(run(b)) for b in blockers]
    while len(stamp) < len(blockers):
        await asyncio.sleep(0.005)
    for req in waiting:
        tasks.append(asyncio.ensure_future(run(req)))
        while h.num_unfinished() < len(tasks):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)  # in the engine core's queue, not only in its front end
    await asyncio.gather(*tasks)
    return stamp


@pytest.mark.engine
def test_a_leg_waiting_for_a_slot_is_queued_by_the_requests_first_arrival(host):
    """Every running slot is taken, a new request waits, then a moved one (first arrival 100 s ago)
    comes: the next free slot goes to the moved one, not to the one that came to this replica first."""
    h, loop = host
    slots = h.cfg.engine.max_num_seqs
    # Blockers end 4 steps apart, so each frees one slot while the others still run.
    blockers = [greedy(f"block-{i}", range(5, 40), 24 + 4 * i) for i in range(slots)]
    stamp = loop.run_until_complete(
        first_tokens(
            h, blockers, [greedy("new", range(7, 40), 8), greedy("moved", range(9, 40), 8, time.time() - 100.0)]
        )
    )
    assert stamp["moved"] < stamp["new"]
    assert settle(h, loop) == 0


@pytest.mark.engine
def test_a_leg_waiting_for_kv_blocks_is_queued_by_the_requests_first_arrival(tiny_model):
    """Free slots but no free KV block (nothing is held back by the batching policy, so vLLM's own
    waiting queue decides): the moved request is still admitted before the new one, and a request
    with a lower `priority` (the API field) before both."""
    with running_host(tiny_model, max_model_len=256, num_kv_blocks=3) as (h, loop):
        block = h.engine.vllm_config.cache_config.block_size
        # vLLM keeps one block aside; the two blockers take one of the others each, the first ends
        # 10 steps before the second (each fits its block: 20 prompt + at most 106 output tokens).
        blockers = [greedy(f"block-{i}", range(i, i + 20), block - 32 + 10 * i) for i in range(2)]
        # The first block freed takes each waiting request in turn (4 tokens each).
        waiting = [
            greedy("new", range(300, 335), 4),
            greedy("moved", range(400, 435), 4, time.time() - 100.0),
            greedy("urgent", range(100, 135), 4, priority=-1),
        ]
        stamp = loop.run_until_complete(first_tokens(h, blockers, waiting))
        assert stamp["urgent"] < stamp["moved"] < stamp["new"]
        assert settle(h, loop) == 0


class CountingEngine:
    """Stands in for AsyncLLM where only the calls matter."""

    def __init__(self):
        self.aborts, self.generated = [], []

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)

    def generate(self, prompt, params, request_id, lora_request=None, priority=0):
        self.generated.append(request_id)
        return self._outputs()

    async def _outputs(self):
        return
        yield


def test_an_old_abort_does_not_end_a_later_request_with_its_id(monkeypatch):
    """An abort for a request the replica no longer has (it ended as the abort came) is forgotten
    after EARLY_ABORT_TTL_S: a later leg with the same id is not ended by it."""
    h = EngineHost(config.DloraConfig(), "/models/m")
    h.engine = CountingEngine()
    monkeypatch.setattr(engine_mod, "engine_input", lambda engine, req: list(req.prompt_token_ids))

    async def go():
        await h.abort("old")
        await h.abort("fresh")
        h._early_aborts["old"] -= engine_mod.EARLY_ABORT_TTL_S + 1
        return [d async for d in h.generate(request("old"))], [d async for d in h.generate(request("fresh"))]

    old, fresh = asyncio.run(go())
    assert h.engine.aborts == ["old", "fresh"]  # both aborts were passed to vLLM as well
    assert h.engine.generated == ["old"]  # only the request whose abort had expired reached vLLM
    assert [d.finish_reason for d in fresh] == ["abort"] and old == []
    assert not h._early_aborts  # both consumed


def test_a_repeated_abort_that_fails_ends_quietly():
    """The engine dies while an early abort is being repeated: the repeat stops without an error of
    its own (the stream fails as a replica failure, which the router handles)."""

    class DyingEngine:
        calls = 0

        async def abort(self, request_id: str) -> None:
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("engine core died")

    h = EngineHost(config.DloraConfig(), "/models/m")
    h.engine = DyingEngine()

    async def go():
        h._streams["r"] = asyncio.Event()  # a stream vLLM has not registered yet
        await h.abort("r")
        retries = list(h._retries)
        await asyncio.gather(*retries)  # raises if the repeat raised
        return len(retries)

    assert asyncio.run(go()) == 1
    assert h.engine.calls == 2 and not h._retries


@pytest.mark.engine
def test_a_moved_structured_output_resumes_its_grammar_where_it_stopped(host):
    """A request moved after k tokens continues on `prompt + those k tokens`: its grammar replays
    them and the rest equals the undisturbed run's; without the replay the grammar would start over
    (a second opening brace)."""
    h, loop = host
    prompt = tuple(range(5, 40))
    spec = SamplingSpec(max_tokens=40, temperature=0.0, structured_outputs=json.dumps({"json": ORDER}))

    async def run(req: GenerateRequest) -> tuple[list[int], str]:
        deltas = [d async for d in h.generate(req)]
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

    def moved_after(ids: list[int], k: int, replay: int) -> tuple[list[int], str]:
        leg = dataclasses.replace(spec, max_tokens=spec.max_tokens - k, generated_before=replay)
        return loop.run_until_complete(run(GenerateRequest(f"moved-{k}-{replay}", prompt + tuple(ids[:k]), leg)))

    whole, text = loop.run_until_complete(run(GenerateRequest("whole", prompt, spec)))
    assert text.startswith("{") and len(whole) > 6
    for k in (1, 5):
        rest, rest_text = moved_after(whole, k, replay=k)
        assert rest == whole[k:]
        assert not rest_text.lstrip().startswith("{")
    restarted, restarted_text = moved_after(whole, 5, replay=0)
    assert restarted_text.startswith("{") and restarted != whole[5:]


@pytest.mark.engine
def test_a_moved_requests_penalties_count_the_tokens_of_its_earlier_legs(host):
    """Presence and frequency penalties over the whole output: the continuation of a request moved
    after k tokens (which has them in its prompt) goes on as the unmoved request does; counted as
    prompt, they would not be penalised and the rest would differ."""
    h, loop = host
    prompt, k = tuple(range(5, 40)), 30
    spec = SamplingSpec(max_tokens=60, temperature=0.0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)

    async def run(req: GenerateRequest) -> list[int]:
        return [t for d in [d async for d in h.generate(req)] for t in d.token_ids]

    def moved(ids: list[int], generated_before: int) -> list[int]:
        leg = dataclasses.replace(spec, max_tokens=spec.max_tokens - k, generated_before=generated_before)
        return loop.run_until_complete(run(GenerateRequest(f"pen-{generated_before}", prompt + tuple(ids[:k]), leg)))

    whole = loop.run_until_complete(run(GenerateRequest("pen-whole", prompt, spec)))
    assert moved(whole, k) == whole[k:]
    assert moved(whole, 0) != whole[k:]

"""Batch lines count their completions (prompts x n) against server.max_pending_requests, in the room
online requests leave and never more than half of it, while online admission is as it was: on the
real app and router over a slow toy replica."""

from __future__ import annotations

import asyncio
import time

import openai

from tests.batch.test_batch_api import metric_values, request_line, submit, toy_server, until

MAX_PENDING = 8
HALF = MAX_PENDING // 2


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_batch_choices_take_half_the_limit_and_never_cost_online_a_429(tiny_model, tmp_path):
    lines = [request_line(f"r{i}", "a0", f"prompt {i}", max_tokens=40, n=3, seed=i, temperature=0.5) for i in range(4)]

    async def run():
        async with toy_server(
            tiny_model, tmp_path / "state", step_s=0.02, **{"server.max_pending_requests": MAX_PENDING}
        ) as (client, state, _):
            gate = state.batches.gate
            batch_choices: list[int] = []  # sampled all along
            gauge: list[float] = []
            while_online_full: list[int] = []  # batch choices sampled while online holds the whole limit
            online_full = asyncio.Event()

            async def sample() -> None:
                while True:
                    batch_choices.append(gate.choices_in_flight)
                    gauge.append(metric_values(state)["dlora_batch_choices_in_flight"])
                    if online_full.is_set() and state.admitted.count == MAX_PENDING:
                        while_online_full.append(gate.choices_in_flight)
                    await asyncio.sleep(0.005)

            sampler = asyncio.create_task(sample())
            batch = await submit(client, lines)
            await wait_for(lambda: gate.choices_in_flight > 0)
            assert gate.choices_in_flight == 3

            # Online requests fill the whole limit beside the batch line in flight: none is refused.
            online = [
                asyncio.ensure_future(
                    client.completions.create(model="a1", prompt=f"online {i}", max_tokens=60, n=4, seed=i)
                )
                for i in range(2)
            ]
            await wait_for(lambda: state.admitted.count == MAX_PENDING or any(o.done() for o in online))
            for o in (o for o in online if o.done()):
                o.result()  # raises the 429 had batch work cost an online request its place
            held = gate.choices_in_flight
            online_full.set()
            assert held == 3  # online and batch together past the limit, briefly
            try:
                await client.completions.create(model="a1", prompt="one too many", max_tokens=2)
                raise AssertionError("a 9th online completion was admitted")
            except openai.RateLimitError as e:
                assert e.status_code == 429 and "server.max_pending_requests" in str(e)
            for response in await asyncio.gather(*online):
                assert len(response.choices) == 4
            online_full.clear()

            done = await until(client, batch.id, ("completed",), timeout=20)
            sampler.cancel()
            assert done.request_counts.completed == 4 and done.request_counts.failed == 0
            # One n=3 line at a time fits the half (4); a second would make 6.
            assert max(batch_choices) == 3 and max(gauge) == 3 and gate.choices_in_flight == 0
            # With online holding the whole limit, no batch line started.
            assert while_online_full and max(while_online_full) <= held

    asyncio.run(run())

"""From an API request to engine work: resolve the model, size max_tokens, fan out n × prompts.

Both /v1/completions and /v1/chat/completions go through here; they differ only in how prompts are
tokenized and how outputs are formatted. Each choice is its own engine request so the router can
place, migrate and resubmit it independently.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dlora.adapters.lifecycle import AdapterManager, AdapterResolveError, AdapterUnavailableError, ref_of
from dlora.adapters.registry import AdapterNotFoundError, AdapterRecord
from dlora.adapters.resolver import AdapterSourceError
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, SamplingSpec, TokenLogprob
from dlora.server.errors import APIError
from dlora.server.protocol import SamplingFields
from dlora.server.validation import check_sampling


@dataclass(frozen=True)
class Job:
    """One choice: prompt `prompt_index`, sample `sample_index` of n."""

    index: int
    prompt_index: int
    request: GenerateRequest


@dataclass
class ChoiceResult:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


async def resolve_adapter(state, model: str) -> AdapterRef | None:
    """None for the base model; 404 for a name nobody registered (and no resolver finds)."""
    if model == state.base_model_name:
        return None
    return ref_of(await lookup_adapter(state.adapters, model))


async def lookup_adapter(adapters: AdapterManager, model: str) -> AdapterRecord:
    """The adapter named `model`, registered or found by a resolver; else dlora's APIError saying
    why it cannot be served (404 unknown, 400 bad files, 503 source or stored copy unavailable)."""
    try:
        return await adapters.lookup_or_resolve(model)
    except AdapterSourceError:
        raise APIError(
            503, f"The adapter `{model}` could not be looked up: its source is not reachable; retry later.", "model"
        ) from None
    except AdapterResolveError:
        raise APIError(
            400,
            f"The adapter `{model}` was found but could not be loaded: its files failed validation "
            "(the server log says why).",
            "model",
        ) from None
    except AdapterUnavailableError:
        # Registered, but its stored copy changed or vanished: the operator must register it again.
        raise APIError(
            503,
            f"The adapter `{model}` is registered but its stored files are damaged or missing; "
            "it cannot be served until it is registered again.",
            "model",
        ) from None
    except AdapterNotFoundError:
        raise APIError(404, f"The model `{model}` does not exist.", "model") from None


def max_tokens_for(body: SamplingFields, prompt_len: int, max_model_len: int) -> int:
    """vLLM's rule: default to what fits; refuse prompt + max_tokens beyond the context."""
    room = max_model_len - prompt_len
    if body.max_tokens is None:
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"has {prompt_len} tokens, which leaves no room for completion tokens.",
                "messages",
            )
        return room
    if body.max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + body.max_tokens} tokens ({prompt_len} in the prompt, {body.max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    return body.max_tokens


def sampling_spec(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def make_jobs(
    request_id: str,
    prompts: list[list[int]],
    body: SamplingFields,
    adapter: AdapterRef | None,
    logprobs: int | None,
    max_model_len: int,
    vocab_size: int,
) -> list[Job]:
    jobs = []
    for p_idx, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, "prompt must contain at least one token", "prompt")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise APIError(400, f"prompt token ids must lie in [0, {vocab_size})", "prompt")
        spec = sampling_spec(body, max_tokens_for(body, len(ids), max_model_len), logprobs)
        for s_idx in range(body.n):
            # Distinct seeds per sample, or every sample of a seeded n>1 request would be the same.
            seed = None if spec.seed is None else spec.seed + s_idx
            index = p_idx * body.n + s_idx
            sampling = dataclasses.replace(spec, seed=seed)
            # Here, before any engine (or a stream's first byte), not inside a replica as a 500.
            check_sampling(sampling, vocab_size)
            req = GenerateRequest(
                request_id=f"{request_id}-{index}",
                prompt_token_ids=tuple(ids),
                sampling=sampling,
                adapter=adapter,
                priority=body.priority,
            )
            jobs.append(Job(index=index, prompt_index=p_idx, request=req))
    return jobs


STOP = object()  # put in run_jobs' queue: the run ends there, as if its caller had left


async def run_jobs(
    state, jobs: list[Job], adapter_label: str, queue: asyncio.Queue | None = None
) -> AsyncIterator[tuple[Job, Delta]]:
    """Run every job concurrently and yield (job, delta) in arrival order.

    Leaving the iterator early (client disconnect, error) cancels every job, which aborts the
    requests inside the engines; so does `STOP` put in `queue` (the caller's, when given).
    """
    queue = asyncio.Queue() if queue is None else queue
    done_marker = object()

    async def run(job: Job) -> None:
        tracker = state.metrics.track(adapter_label, len(job.request.prompt_token_ids))
        status = "error"
        try:
            async for delta in state.router.generate(job.request):
                tracker.on_tokens(len(delta.token_ids))
                await queue.put((job, delta))
            status = "ok"
        except asyncio.CancelledError:
            status = "aborted"
            raise
        except Exception as e:
            await queue.put((job, e))
        finally:
            tracker.finish(status)
            await queue.put((job, done_marker))

    tasks = [asyncio.create_task(run(j)) for j in jobs]
    remaining = len(tasks)
    try:
        while remaining:
            got = await queue.get()
            if got is STOP:
                return
            job, item = got
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield job, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(state, jobs: list[Job], adapter_label: str) -> list[ChoiceResult]:
    results = {j.index: ChoiceResult(j.index, j.prompt_index) for j in jobs}
    async for job, delta in run_jobs(state, jobs, adapter_label):
        results[job.index].add(delta)
    return [results[i] for i in sorted(results)]

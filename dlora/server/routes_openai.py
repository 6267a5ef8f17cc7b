"""/v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dlora.server import formatting as fmt
from dlora.server import templates
from dlora.server.auth import require_api_key
from dlora.server.errors import APIError, as_api_error, error_body, error_response
from dlora.server.generation import Job, collect, make_jobs, resolve_adapter, run_jobs
from dlora.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from dlora.server.validation import check_policy, check_values, request_template

# Every route here is an inference route: the API key (when set) guards all of them.
router = APIRouter(dependencies=[Depends(require_api_key)])


async def until_disconnect(request: Request, work: Awaitable):
    """Run `work`, cancelling it if the client disconnects first (aborts the engine requests)."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(error_body(499, "client disconnected"), status_code=499)
    finally:
        watcher.cancel()


async def _tokenize_prompts(state, prompt) -> tuple[list[list[int]], list[str | None]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    texts = [p if isinstance(p, str) else None for p in prompt]
    encoded = iter(await templates.encode_prompts(state.tokenizer, [t for t in texts if t is not None]))
    ids = [next(encoded) if t is not None else list(p) for p, t in zip(prompt, texts)]
    return ids, texts


async def _chat_prompt(state, body: ChatCompletionRequest) -> list[int]:
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    template, _ = request_template(body)
    return await templates.chat_prompt(
        state.tokenizer,
        messages,
        body.add_generation_prompt,
        body.chat_template_kwargs or {},
        template,
        state.cfg.server.template_timeout_s,
    )


def _admit(state, body: SamplingFields) -> None:
    """The checks every request passes before its model is even looked up."""
    check_values(body)
    check_policy(body, state.cfg.server)


async def _answer(request_id: str, work: Awaitable[Response]) -> Response:
    """Run a route's work; any error becomes an OpenAI-shaped response. The request id the client
    sees in the body's `id` is also in an X-Request-Id header, on errors too."""
    headers = {"X-Request-Id": request_id}
    try:
        response = await work
    except Exception as e:
        err = as_api_error(e, request_id)
        return error_response(err.status, err.message, err.param, headers=headers)
    response.headers.update(headers)
    return response


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(
    state, jobs: list[Job], label: str, chunk: Callable, usage_chunk: Callable | None, first_chunks: Sequence[dict] = ()
) -> AsyncIterator[str]:
    prompt_tokens = sum(len(j.request.prompt_token_ids) for j in jobs)
    completion_tokens = 0
    request_id = jobs[0].request.request_id.rsplit("-", 1)[0]
    try:
        for c in first_chunks:
            yield fmt.sse(c)
        async for job, delta in run_jobs(state, jobs, label):
            completion_tokens += len(delta.token_ids)
            yield fmt.sse(chunk(job, delta))
        if usage_chunk is not None:
            yield fmt.sse(usage_chunk(fmt.usage(prompt_tokens, completion_tokens)))
    except Exception as e:
        err = as_api_error(e, request_id)
        yield fmt.sse(error_body(err.status, err.message, err.param))
    yield fmt.sse("[DONE]")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    rid = f"cmpl-{uuid.uuid4().hex}"
    return await _answer(rid, _completions(body, request, rid))


async def _completions(body: CompletionRequest, request: Request, rid: str) -> Response:
    state = request.app.state.dlora
    if not body.stream:
        return await until_disconnect(request, _json(completion_body(state, body, rid)))
    call = await _prepare_completion(state, body, rid)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sent_prefix: set[int] = set()

    def chunk(job: Job, delta) -> dict:
        pre = "" if job.index in sent_prefix else call.prefix(job)
        sent_prefix.add(job.index)
        return call.envelope([fmt.completion_chunk_choice(job.index, delta, pre, body.return_token_ids)])

    usage_chunk = (lambda u: call.envelope([]) | {"usage": u}) if include_usage else None
    return _sse_response(_stream(state, call.jobs, call.label, chunk, usage_chunk))


async def _json(work: Awaitable[dict]) -> JSONResponse:
    return JSONResponse(await work)


@dataclass
class _CompletionCall:
    """A /v1/completions request turned into engine jobs, and what its responses are built from."""

    rid: str
    body: CompletionRequest
    jobs: list[Job]
    prompts: list[list[int]]
    texts: list[str | None]
    label: str
    detokenize: Callable[[list[int]], str]
    created: int = field(default_factory=lambda: int(time.time()))

    def prefix(self, job: Job) -> str:
        if not self.body.echo:
            return ""
        text = self.texts[job.prompt_index]
        return text if text is not None else self.detokenize(self.prompts[job.prompt_index])

    def envelope(self, choices: list[dict]) -> dict:
        return fmt.envelope(self.rid, "text_completion", self.created, self.body.model, choices)


async def _prepare_completion(state, body: CompletionRequest, rid: str, priority: int | None = None) -> _CompletionCall:
    _admit(state, body)
    if priority is not None:
        body = body.model_copy(update={"priority": priority})
    adapter = await resolve_adapter(state, body.model)
    prompts, texts = await _tokenize_prompts(state, body.prompt)
    jobs = make_jobs(rid, prompts, body, adapter, body.logprobs, state.max_model_len, state.vocab_size)
    label = "" if adapter is None else body.model
    return _CompletionCall(rid, body, jobs, prompts, texts, label, state.tokenizer.decode)


async def completion_body(state, body: CompletionRequest, rid: str, priority: int | None = None) -> dict:
    """A whole (non-streamed) /v1/completions response body. `priority` replaces the request's
    engine priority after the client's own value was checked (batch work runs behind online)."""
    call = await _prepare_completion(state, body, rid, priority)
    results = await collect(state, call.jobs, call.label)
    ids = call.prompts if body.return_token_ids else None
    choices = [
        fmt.completion_choice(r, call.prefix(call.jobs[i]), ids[r.prompt_index] if ids else None)
        for i, r in enumerate(results)
    ]
    prompt_tokens = sum(len(p) for p in call.prompts)
    return call.envelope(choices) | {"usage": fmt.usage(prompt_tokens, sum(len(r.token_ids) for r in results))}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return await _answer(rid, _chat_completions(body, request, rid))


async def _chat_completions(body: ChatCompletionRequest, request: Request, rid: str) -> Response:
    state = request.app.state.dlora
    if not body.stream:
        return await until_disconnect(request, _json(chat_completion_body(state, body, rid)))
    call = await _prepare_chat(state, body, rid)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    first = [call.envelope("chat.completion.chunk", [fmt.chat_role_choice(j.index) for j in call.jobs])]

    def chunk(job: Job, delta) -> dict:
        return call.envelope("chat.completion.chunk", [fmt.chat_chunk_choice(job.index, delta, body.return_token_ids)])

    usage_chunk = (lambda u: call.envelope("chat.completion.chunk", []) | {"usage": u}) if include_usage else None
    return _sse_response(_stream(state, call.jobs, call.label, chunk, usage_chunk, first))


@dataclass
class _ChatCall:
    """A /v1/chat/completions request turned into engine jobs."""

    rid: str
    body: ChatCompletionRequest
    jobs: list[Job]
    prompt: list[int]
    label: str
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return fmt.envelope(self.rid, obj, self.created, self.body.model, choices)


async def _prepare_chat(state, body: ChatCompletionRequest, rid: str, priority: int | None = None) -> _ChatCall:
    _admit(state, body)
    if priority is not None:
        body = body.model_copy(update={"priority": priority})
    adapter = await resolve_adapter(state, body.model)
    prompt = await _chat_prompt(state, body)
    jobs = make_jobs(rid, [prompt], body, adapter, body.num_logprobs(), state.max_model_len, state.vocab_size)
    return _ChatCall(rid, body, jobs, prompt, "" if adapter is None else body.model)


async def chat_completion_body(state, body: ChatCompletionRequest, rid: str, priority: int | None = None) -> dict:
    """A whole (non-streamed) /v1/chat/completions response body; `priority` as in completion_body."""
    call = await _prepare_chat(state, body, rid, priority)
    results = await collect(state, call.jobs, call.label)
    out = call.envelope("chat.completion", [fmt.chat_choice(r, body.return_token_ids) for r in results])
    out["usage"] = fmt.usage(len(call.prompt), sum(len(r.token_ids) for r in results))
    if body.return_token_ids:
        out["prompt_token_ids"] = call.prompt
    return out


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.dlora
    base = state.base_model_name

    def card(model_id: str, parent: str | None, root: str) -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "dlora",
            "root": root,
            "parent": parent,
            "max_model_len": state.max_model_len,
        }

    data = [card(base, None, state.model_path)]
    data += [card(r.name, base, r.path) for r in state.adapters.registry.all()]
    return {"object": "list", "data": data}

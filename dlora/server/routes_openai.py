"""/v1/completions, /v1/chat/completions and /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dlora.server import formatting as fmt
from dlora.server.errors import APIError, error_body
from dlora.server.generation import Job, collect, make_jobs, resolve_adapter, run_jobs
from dlora.server.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


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


def _tokenize_prompts(state, prompt) -> tuple[list[list[int]], list[str | None]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids.append(state.tokenizer(p, add_special_tokens=True)["input_ids"])
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def _chat_prompt(state, body: ChatCompletionRequest) -> list[int]:
    messages = []
    try:
        for m in body.messages:
            messages.append({"role": m.role, "content": m.text()})
        text = state.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # jinja errors from a template that rejects the conversation
        raise APIError(400, f"chat template failed: {e}", "messages") from None
    return state.tokenizer(text, add_special_tokens=False)["input_ids"]


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream(state, jobs: list[Job], label: str, chunk: Callable, usage_chunk: Callable | None,
                  first_chunks: list[dict] = ()) -> AsyncIterator[str]:
    prompt_tokens = sum(len(j.request.prompt_token_ids) for j in jobs)
    completion_tokens = 0
    try:
        for c in first_chunks:
            yield fmt.sse(c)
        async for job, delta in run_jobs(state, jobs, label):
            completion_tokens += len(delta.token_ids)
            yield fmt.sse(chunk(job, delta))
        if usage_chunk is not None:
            yield fmt.sse(usage_chunk(fmt.usage(prompt_tokens, completion_tokens)))
    except APIError as e:
        yield fmt.sse(error_body(e.status, e.message, e.param))
    except Exception as e:
        yield fmt.sse(error_body(500, f"generation failed: {e}"))
    yield fmt.sse("[DONE]")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = request.app.state.dlora
    adapter = resolve_adapter(state, body.model)
    prompts, texts = _tokenize_prompts(state, body.prompt)
    jobs = make_jobs(f"cmpl-{uuid.uuid4().hex}", prompts, body, adapter, body.logprobs,
                     state.max_model_len, state.vocab_size)
    rid, created, label = jobs[0].request.request_id.rsplit("-", 1)[0], int(time.time()), body.model
    if adapter is None:
        label = ""

    def prefix(job: Job) -> str:
        if not body.echo:
            return ""
        text = texts[job.prompt_index]
        return text if text is not None else state.tokenizer.decode(prompts[job.prompt_index])

    def envelope(choices: list[dict]) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model, "choices": choices}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sent_prefix: set[int] = set()

        def chunk(job: Job, delta) -> dict:
            pre = "" if job.index in sent_prefix else prefix(job)
            sent_prefix.add(job.index)
            choice = {"index": job.index, "text": pre + delta.text,
                      "logprobs": fmt.completion_logprobs(delta.logprobs, 0),
                      "finish_reason": delta.finish_reason if delta.finished else None,
                      "stop_reason": delta.stop_reason if delta.finished else None}
            if body.return_token_ids:
                choice["token_ids"] = delta.token_ids
            return envelope([choice])

        usage_chunk = (lambda u: envelope([]) | {"usage": u}) if include_usage else None
        return _sse_response(_stream(state, jobs, label, chunk, usage_chunk))

    async def whole() -> JSONResponse:
        results = await collect(state, jobs, label)
        choices = [
            fmt.completion_choice(r, prefix(jobs[i]), prompts[r.prompt_index] if body.return_token_ids else None)
            for i, r in enumerate(results)
        ]
        prompt_tokens = sum(len(p) for p in prompts)
        return JSONResponse(envelope(choices) | {
            "usage": fmt.usage(prompt_tokens, sum(len(r.token_ids) for r in results))})

    return await until_disconnect(request, whole())


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = request.app.state.dlora
    adapter = resolve_adapter(state, body.model)
    prompt = _chat_prompt(state, body)
    jobs = make_jobs(f"chatcmpl-{uuid.uuid4().hex}", [prompt], body, adapter, body.num_logprobs(),
                     state.max_model_len, state.vocab_size)
    rid, created = jobs[0].request.request_id.rsplit("-", 1)[0], int(time.time())
    label = "" if adapter is None else body.model

    def envelope(obj: str, choices: list[dict]) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": body.model, "choices": choices}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        first = [envelope("chat.completion.chunk", [
            {"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None} for j in jobs])]

        def chunk(job: Job, delta) -> dict:
            choice = {"index": job.index, "delta": {"content": delta.text},
                      "logprobs": fmt.chat_logprobs(delta.logprobs),
                      "finish_reason": delta.finish_reason if delta.finished else None,
                      "stop_reason": delta.stop_reason if delta.finished else None}
            if body.return_token_ids:
                choice["token_ids"] = delta.token_ids
            return envelope("chat.completion.chunk", [choice])

        usage_chunk = (lambda u: envelope("chat.completion.chunk", []) | {"usage": u}) if include_usage else None
        return _sse_response(_stream(state, jobs, label, chunk, usage_chunk, first))

    async def whole() -> JSONResponse:
        results = await collect(state, jobs, label)
        body_json = envelope("chat.completion", [fmt.chat_choice(r, body.return_token_ids) for r in results])
        body_json["usage"] = fmt.usage(len(prompt), sum(len(r.token_ids) for r in results))
        if body.return_token_ids:
            body_json["prompt_token_ids"] = prompt
        return JSONResponse(body_json)

    return await until_disconnect(request, whole())


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.dlora
    base = state.base_model_name

    def card(model_id: str, parent: str | None, root: str) -> dict:
        return {"id": model_id, "object": "model", "created": state.created, "owned_by": "dlora",
                "root": root, "parent": parent, "max_model_len": state.max_model_len}

    data = [card(base, None, state.model_path)]
    data += [card(r.name, base, r.path) for r in state.adapters.registry.all()]
    return {"object": "list", "data": data}

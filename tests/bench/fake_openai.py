"""A tiny OpenAI-compatible streaming server for the bench tests (FastAPI + uvicorn in a thread).

It lists a base model and three adapters, streams `max_tokens` tokens ("tok0 tok1 ...") with
`token_delay` seconds between them, appends a usage chunk when asked, and answers unknown models
with 404 like vLLM. `send_usage = False` drops the usage chunk to test the chunk-count fallback.
`adapter_list`, when set, is what GET /v1/adapters answers (dlora's list with SLOs); unset, that
route is a 404 as on vLLM.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BASE = "tiny-base"
ADAPTERS = ("a0", "a1", "a2")
MAX_MODEL_LEN = 256


@dataclass
class FakeState:
    token_delay: float = 0.002
    first_token_delay: float = 0.005
    send_usage: bool = True
    cached_tokens: int | None = None  # reported in usage.prompt_tokens_details when set
    adapter_list: dict | None = None
    received: list[dict] = field(default_factory=list)


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": BASE, "object": "model", "parent": None, "root": BASE, "max_model_len": MAX_MODEL_LEN}]
        data += [{"id": a, "object": "model", "parent": BASE, "root": f"/adapters/{a}"} for a in ADAPTERS]
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters():
        if state.adapter_list is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return state.adapter_list

    async def stream(body: dict, chat: bool):
        n = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        rid = f"cmpl-{len(state.received)}"
        if chat:
            yield _sse({"id": rid, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(state.first_token_delay)
        for i in range(n):
            if i:
                await asyncio.sleep(state.token_delay)
            piece = f"tok{i} "
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if i == n - 1 else None
            yield _sse({"id": rid, "choices": [choice], "usage": None})
        if state.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt_tokens = len(str(body.get("prompt") or body.get("messages")).split())
            yield _sse(
                {
                    "id": rid,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": n,
                        "total_tokens": prompt_tokens + n,
                        "prompt_tokens_details": None
                        if state.cached_tokens is None
                        else {"cached_tokens": state.cached_tokens},
                    },
                }
            )
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state.received.append(body)
        if body.get("model") not in (BASE, *ADAPTERS):
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model `{body.get('model')}` does not exist.",
                        "type": "NotFoundError",
                        "code": 404,
                    }
                },
                status_code=404,
            )
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class FakeServer:
    def __init__(self) -> None:
        self.state = FakeState()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> FakeServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

"""Streaming OpenAI client for /v1/completions and /v1/chat/completions, timing every token.

Per request it records what `vllm bench serve` records, under the same names:
- `ttft`: send → first chunk carrying a token (chat chunks that only announce the role are skipped);
- `itl`: gaps between consecutive token chunks;
- `latency`: send → last token chunk (E2EL);
- `output_tokens`: `usage.completion_tokens` from the final chunk (requested with
  `stream_options.include_usage`), else the number of token chunks;
- `cached_tokens`: `usage.prompt_tokens_details.cached_tokens`, where the server reports it (vLLM's
  and dlora's `--enable-prompt-tokens-details`; both leave it out when nothing was cached).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dlora.bench.workload import Request

CHAT_ENDPOINT_SUFFIX = "chat/completions"


class BenchError(Exception):
    """The benchmark cannot run; the message says why in one line."""


class ServerUnreachable(BenchError):
    pass


class NoSuchEndpoint(ServerUnreachable):
    """The server answered 404 for the path: it is not dlora, or an older one."""


class UnknownAdapter(BenchError):
    pass


@dataclass
class RequestResult:
    request_id: str
    adapter: str | None
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds, E2EL
    start_time: float = 0.0  # seconds after the benchmark started
    client_queue_time: float = 0.0  # seconds spent waiting for --max-concurrency
    generated_text: str = ""
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache


def is_chat(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith(CHAT_ENDPOINT_SUFFIX)


def build_payload(req: Request, model: str, chat: bool, ignore_eos: bool, extra_body: dict | None = None) -> dict:
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.output_len
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


def _token_of(chunk: dict, chat: bool) -> str | None:
    """The text a streamed chunk carries, or None when it carries no token."""
    choices = chunk.get("choices")
    if not choices:
        return None
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    content = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if not content and "role" in delta:
        return None
    return content or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    req: Request,
    model: str,
    *,
    chat: bool,
    ignore_eos: bool = False,
    extra_body: dict | None = None,
    t0: float = 0.0,
) -> RequestResult:
    """Send one streaming request; never raises for HTTP or network errors (they go in `.error`)."""
    out = RequestResult(req.request_id, req.adapter, req.prompt_len)
    payload = build_payload(req, model, chat, ignore_eos, extra_body)
    start = time.perf_counter()
    out.start_time = start - t0
    last = start
    chunks = 0
    usage_tokens = None
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                token = _token_of(chunk, chat)
                if token is not None:
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append(token)
                if usage := chunk.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    if usage.get("prompt_tokens") is not None:
                        out.prompt_len = usage["prompt_tokens"]
                    if isinstance(details := usage.get("prompt_tokens_details"), dict):
                        out.cached_tokens = details.get("cached_tokens")
    except Exception as e:  # network, protocol or a malformed chunk: the request failed, the run goes on
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text)
    if chunks == 0:
        out.error = "the stream ended without a token"
        return out
    out.success = True
    out.latency = last - start
    out.output_tokens = usage_tokens if usage_tokens else chunks
    return out


def _error_message(body: str) -> str:
    try:
        err = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:200]
    if isinstance(err, dict):
        inner = err.get("error", err)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner)[:200]
        return str(err.get("detail") or err.get("message") or inner)[:200]
    return str(err)[:200]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _get_list(base_url: str, path: str, token: str | None, timeout: float) -> dict:
    """The JSON object `{"data": [...], ...}` GET `path` answers; raises ServerUnreachable with one
    clear line otherwise."""
    url = base_url.rstrip("/") + path
    try:
        async with httpx.AsyncClient(timeout=timeout, headers=_headers(token)) as client:
            resp = await client.get(url)
    except httpx.HTTPError as e:
        raise ServerUnreachable(
            f"cannot reach the server at {base_url} ({type(e).__name__}: {e or 'no response'})"
        ) from None
    if resp.status_code == 404:
        raise NoSuchEndpoint(f"GET {url} answered HTTP 404: {_error_message(resp.text)}")
    if resp.status_code != 200:
        raise ServerUnreachable(f"GET {url} answered HTTP {resp.status_code}: {_error_message(resp.text)}")
    try:
        body = resp.json()
        if isinstance(body, dict) and isinstance(body["data"], list):
            return body
    except (ValueError, KeyError):
        pass
    raise ServerUnreachable(f"GET {url} did not return a list object")


async def fetch_models(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> list[dict]:
    """The entries of GET /v1/models; raises ServerUnreachable with one clear line otherwise."""
    return list((await _get_list(base_url, "/v1/models", api_key, timeout))["data"])


async def fetch_adapter_list(base_url: str, admin_token: str | None = None, timeout: float = 10.0) -> dict:
    """dlora's GET /v1/adapters (the registered adapters with their SLOs, docs/api.md), as sent;
    raises ServerUnreachable saying why not, NoSuchEndpoint where the server is not dlora (404)."""
    return await _get_list(base_url, "/v1/adapters", admin_token, timeout)


def check_models(models: list[dict], wanted: list[str], base_url: str) -> None:
    """Raise UnknownAdapter naming every model/adapter in `wanted` that the server does not list."""
    served = [m.get("id") for m in models]
    missing = [w for w in wanted if w not in served]
    if missing:
        raise UnknownAdapter(
            f"unknown adapter/model {', '.join(repr(m) for m in missing)}: the server at {base_url} serves "
            f"{', '.join(map(str, served)) or 'nothing'}"
        )


def base_model_of(models: list[dict]) -> str:
    """The base model among /v1/models entries: the `parent` of adapters, else the first entry."""
    ids: list[Any] = [m.get("id") for m in models]  # JSON values, as the server sent them
    for m in models:
        if m.get("parent") and m["parent"] in ids:
            return m["parent"]
    for m in models:
        if not m.get("parent"):
            return m["id"]
    if not ids:
        raise BenchError("the server lists no models at /v1/models")
    return ids[0]


def adapters_of(models: list[dict]) -> list[str]:
    """Adapter names among /v1/models entries (entries with a `parent`), in listed order."""
    return [m["id"] for m in models if m.get("parent")]


def make_client(max_concurrency: int | None, timeout: float, api_key: str | None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits, headers=_headers(api_key))

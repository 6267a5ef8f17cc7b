"""OpenAI request bodies (pydantic) and the vLLM extensions dlora accepts.

Unknown fields are ignored, as OpenAI's and vLLM's servers do; known fields are range-checked so a
bad value gets a 400 naming the field rather than a failure inside the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
MAX_LOGPROBS = 20
# vLLM's bounds on `seed` and `priority`: the engine carries them as signed 64-bit integers.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # Lower runs earlier, as in vLLM with `--scheduling-policy priority` (dlora's engines always run
    # it): each engine's waiting queue is ordered by (priority, first arrival). A non-zero value is
    # refused unless server.allow_client_priority is on.
    priority: Int64 = 0

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        return self


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"a text content part's `text` must be a string, not {type(text).__name__}")
            parts.append(text)
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's request-supplied template (also accepted as chat_template_kwargs.chat_template); refused
    # unless server.trust_request_chat_template is on.
    chat_template: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadAdapterRequest(OpenAIModel):
    lora_name: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:/-]+$")]
    lora_path: Annotated[str, Field(min_length=1)]
    pinned: bool = False
    # vLLM's field: replace a registered adapter's weights; requests already running keep the old ones.
    load_inplace: bool = False
    # dlora's: the adapter's latency targets {"ttft_s", "tpot_s"} (seconds); absent: the server's
    # default. Checked by dlora.slo.config.parse_adapter_slo in the route, whose message names the key.
    slo: Any = None


class UnloadAdapterRequest(OpenAIModel):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None

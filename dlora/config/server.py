"""`server:` = the HTTP API: address, keys and tokens, adapter roots and resolution, chat templates
and parsers, and admission limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlora.config.checks import ConfigError, check, check_kinds

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _is_s3_uri(uri: str) -> bool:
    return uri.startswith("s3://") and bool(uri[5:].split("/", 1)[0])


def _api_keys(value: Any) -> tuple[str, ...]:
    """server.api_key as the tuple it is kept as: YAML and overrides give one key, a list of keys,
    or null (no key: the routes are open)."""
    if value is None:
        return ()
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, tuple | list) or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"server.api_key={value!r}: must be a non-empty string, a list of them, or null")
    return tuple(keys)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token for the admin endpoints; None: they take the API key, or are open without one
    # (DLORA_ADMIN_TOKEN overrides).
    admin_token: str | None = None
    # Adapter paths given to the admin API must resolve under one of these directories.
    adapter_roots: tuple[str, ...] = ()
    # A request naming an adapter nobody registered looks for `<root>/<name>` under adapter_roots and
    # registers what it finds as an admin call would (off: such a name is a 404, as in vLLM by default).
    resolve_adapters: bool = False
    # With resolve_adapters, also look in an S3-compatible object store: s3://bucket[/prefix], where
    # <prefix>/<name>/ holds adapter_config.json and adapter_model.safetensors (AWS_* env credentials).
    adapter_s3_uri: str | None = None
    adapter_s3_endpoint_url: str | None = None  # e.g. http://minio:9000; None: AWS's own endpoint
    # Where the adapter registry is persisted so registrations survive a restart.
    state_dir: str = "~/.cache/dlora/state"
    log_level: str = "info"
    # Bearer tokens every /v1 route needs, any one of them (vLLM's --api-key); YAML
    # gives one key or a list; empty = open. DLORA_API_KEY (one key) overrides. Separate from admin_token.
    api_key: tuple[str, ...] = ()
    # A request's own `chat_template` (in chat_template_kwargs or the body) is a Jinja program run by
    # the server: refused unless the operator trusts every client (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # The chat template that replaces the tokenizer's (vLLM's --chat-template): a file, or the template
    # itself when it holds `{`, `}` or a newline; None = the tokenizer's own.
    chat_template: str | None = None
    # vLLM's parser that turns a model's tool-call text into `tool_calls` (--tool-call-parser), by name.
    tool_call_parser: str | None = None
    # Let the model decide when to call a tool (`tool_choice: auto`; --enable-auto-tool-choice). As in
    # vLLM it needs tool_call_parser, which reads the calls out of the model's text.
    enable_auto_tool_choice: bool = False
    # usage.prompt_tokens_details.cached_tokens in responses: the prompt tokens the replica found in
    # its prefix cache (--enable-prompt-tokens-details)
    enable_prompt_tokens_details: bool = False
    # vLLM's parser that separates a reasoning model's thinking into `reasoning_content` (--reasoning-parser).
    reasoning_parser: str | None = None
    # Seconds one request's chat-template rendering + tokenisation may take (off the event loop).
    template_timeout_s: float = 5.0
    # /v1/models shows each card's path as vLLM does (`root`: the model's and adapters' directories);
    # off, `root` is the card's name, so clients learn nothing of the server's file layout.
    show_model_paths: bool = False
    # Client `priority` is honoured only when this is on; else a non-zero priority is refused (400),
    # as vLLM does when its scheduling policy is not `priority`.
    allow_client_priority: bool = False
    # Admission control (what a client sees when one is hit: docs/operating.md).
    max_body_bytes: int = 8 * 1024 * 1024  # request body size; larger -> 413
    max_choices_per_request: int = 256  # prompts x n of one request; more -> 400
    max_pending_requests: int = 4096  # engine requests (choices) in flight in the cluster; more -> 429
    request_timeout_s: float | None = 600.0  # a request's deadline from arrival; None = none
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT: how long in-flight streams may still run

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", _api_keys(self.api_key))
        check_kinds(self, "server")
        check(0 <= self.port < 65536, "server.port", self.port, "must be a TCP port (0-65535)")
        check(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "server.enable_auto_tool_choice",
            self.enable_auto_tool_choice,
            "needs server.tool_call_parser (--tool-call-parser), as vLLM's --enable-auto-tool-choice does",
        )
        check(
            self.adapter_s3_uri is None or _is_s3_uri(self.adapter_s3_uri),
            "server.adapter_s3_uri",
            self.adapter_s3_uri,
            "must be s3://bucket or s3://bucket/prefix",
        )
        check(self.template_timeout_s > 0, "server.template_timeout_s", self.template_timeout_s, "must be > 0")
        for key in ("max_body_bytes", "max_choices_per_request", "max_pending_requests"):
            check(getattr(self, key) >= 1, f"server.{key}", getattr(self, key), "must be a whole number >= 1")
        check(
            self.request_timeout_s is None or self.request_timeout_s > 0,
            "server.request_timeout_s",
            self.request_timeout_s,
            "must be a number of seconds > 0, or null (no deadline)",
        )
        check(self.drain_timeout_s >= 0, "server.drain_timeout_s", self.drain_timeout_s, "must be >= 0")
        check(
            self.log_level in LOG_LEVELS, "server.log_level", self.log_level, f"must be one of {', '.join(LOG_LEVELS)}"
        )

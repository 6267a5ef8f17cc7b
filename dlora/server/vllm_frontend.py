"""vLLM's own OpenAI serving classes in dlora's API process, over dlora's router and adapters.

vLLM builds its frontend from a `VllmConfig`, a renderer (tokenizer and chat template), a model
registry and an `EngineClient`; none of them needs a local engine (vLLM's GPU-less render server
builds the first three the same way). dlora builds them once per server from its config, with
`RouterEngineClient` (dlora.server.engine_client) generating through the cluster, so request fields,
defaults, validation and response and stream shapes are vLLM's, not a re-typed copy:

- `/v1/completions` and `/v1/chat/completions` (vLLM's `OpenAIServingCompletion` and
  `OpenAIServingChat`, and their route functions); batch lines go through the same objects;
- `/v1/responses` (vLLM's `OpenAIServingResponses`), with vLLM's default of storing nothing: a
  `store: true` request is answered and not kept, and GET /v1/responses/{id} (and its cancel) find
  no response (vLLM's 404);
- `/tokenize` and `/detokenize` (vLLM's `ServingTokenization`);
- `/v1/models` (vLLM's `OpenAIServingModels` listing): the base model, then every registered adapter.

What dlora changes, by subclassing:
- the model check: a name is served when it is the base model or an adapter dlora has registered or
  can resolve (`server.resolve_adapters`), with dlora's own answers (404, 400 or 503) for adapters
  that exist but cannot be served. vLLM consults resolvers only under an environment variable and
  answers every failure but a 400 as a 404.
- a chat template that renders for longer than `server.template_timeout_s` is the client's 400
  (vLLM's renderer raises a bare TimeoutError).
- a Responses request's `request_id` is the server's, not the body's: the router keys requests by
  it, and one client must not name another's (the same reason X-Request-Id is replaced).
- a Responses prompt is tokenized as a chat prompt is (no special tokens added to the rendered
  template): vLLM 0.32 adds them, so a template that writes its own BOS starts with two, and the
  same conversation would get another prompt than through /v1/chat/completions.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final, cast

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from vllm.config import ModelConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry, OpenAIServingModels
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelList
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.exceptions import VLLMError
from vllm.lora.request import LoRARequest
from vllm.renderers import TokenizeParams, renderer_from_config
from vllm.renderers.chat_utils import load_chat_template
from vllm.renderers.online_renderer import OnlineRenderer

from dlora.adapters.lifecycle import AdapterManager
from dlora.adapters.registry import AdapterRegistry
from dlora.replica.engine import engine_kwargs
from dlora.server.auth import require_api_key
from dlora.server.engine_client import RouterEngineClient
from dlora.server.errors import APIError, error_body
from dlora.server.generation import lookup_adapter

if TYPE_CHECKING:
    from fastapi import FastAPI

    from dlora.config import DloraConfig
    from dlora.server.state import ServerState

log = logging.getLogger(__name__)

CONTENT_FORMAT: Final = "auto"  # vLLM's default: the chat template decides how message content is given
RESPONSE_ROLE = "assistant"
# vLLM renders chat templates in a thread pool and gives up on one after this many seconds (it reads
# the variable at each render): set from `server.template_timeout_s` when the frontend is built.
RENDER_TIMEOUT_ENV = "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT"


def engine_less_vllm_config(cfg: DloraConfig, model_path: str, served_name: str) -> VllmConfig:
    """The replicas' own engine arguments (dlora.replica.engine) as a `VllmConfig` for the frontend:
    the same model config, and no engine behind it."""
    args = AsyncEngineArgs(**engine_kwargs(cfg, model_path), served_model_name=[served_name])
    model_config = args.create_model_config()
    model_config.quantization = None  # the frontend runs no kernels (as vLLM's render server)
    return VllmConfig(model_config=model_config, structured_outputs_config=args.create_structured_outputs_config())


class AdapterRequests(Mapping[str, LoRARequest]):
    """dlora's adapter registry as vLLM's name -> LoRARequest map, without copying it."""

    def __init__(self, registry: AdapterRegistry):
        self._registry = registry

    def __getitem__(self, name: str) -> LoRARequest:
        rec = self._registry.get(name)  # AdapterNotFoundError is a KeyError
        return LoRARequest(lora_name=rec.name, lora_int_id=rec.int_id, lora_path=rec.path)

    def __iter__(self) -> Iterator[str]:
        return (rec.name for rec in self._registry.all())

    def __len__(self) -> int:
        return len(self._registry)


class DloraServingModels(OpenAIServingModels):
    """vLLM's model registry over dlora's: the base model, then every adapter dlora serves. Loading
    and unloading stay dlora's (its admin routes): vLLM's are not mounted. A card's `root` is where
    vLLM puts the model's or adapter's path; unless `show_paths` (`server.show_model_paths`), it
    is the card's own name, so no client learns the server's file layout."""

    def __init__(
        self,
        client: EngineClient,
        model_path: str,
        served_name: str,
        adapters: AdapterManager,
        show_paths: bool = False,
    ):
        super().__init__(client, [BaseModelPath(name=served_name, model_path=model_path)])
        self._adapters = adapters
        self._show_paths = show_paths

    async def show_available_models(self) -> ModelList:
        listing = await super().show_available_models()
        if not self._show_paths:
            for card in listing.data:
                card.root = card.id
        return listing

    # vLLM types it a dict; its serving code only reads it (dlora's admin routes do the writing).
    @property  # type: ignore[override]
    def lora_requests(self) -> Mapping[str, LoRARequest]:
        """The registered adapters as vLLM names them: a view read at each lookup (the registry
        changes), one adapter at a time (a request looks up one of perhaps thousands)."""
        return AdapterRequests(self._adapters.registry)

    @lora_requests.setter
    def lora_requests(self, _value: dict[str, LoRARequest]) -> None:
        """The base class sets an empty dict; dlora's registry is the only source."""

    async def check_model(self, model_name: str | None) -> ErrorResponse | None:
        """None when `model_name` can be served (resolving it if a resolver finds it), else the
        error response saying why not."""
        if not model_name or self.is_base_model(model_name):
            return None
        try:
            await lookup_adapter(self._adapters, model_name)
        except APIError as e:
            body = error_body(e.status, e.message, e.param)["error"]
            return create_error_response(e.message, body["type"], HTTPStatus(e.status), e.param)
        return None

    async def resolve_lora(self, lora_name: str) -> LoRARequest | ErrorResponse:
        """vLLM asks this for a name it does not list; dlora's resolvers may find it."""
        error = await self.check_model(lora_name)
        return error if error is not None else self.lora_requests[lora_name]


class _DloraModelCheck:
    """vLLM's serving classes' model check, answered by dlora's registry and resolvers."""

    models: OpenAIServingModels | OpenAIModelRegistry

    async def _check_model(self, request: Any) -> ErrorResponse | None:
        return await cast(DloraServingModels, self.models).check_model(request.model)


def render_timed_out(param: str) -> ErrorResponse:
    """The 400 for a chat template that rendered past the limit: a (trusted) request template or a
    pathological conversation, the client's doing either way."""
    limit = float(os.environ[RENDER_TIMEOUT_ENV])
    return create_error_response(
        f"chat template rendering took longer than {limit:g} s", param=param, status_code=HTTPStatus.BAD_REQUEST
    )


class DloraCompletion(_DloraModelCheck, OpenAIServingCompletion):
    """vLLM's /v1/completions serving, with dlora's model check."""


class DloraChat(_DloraModelCheck, OpenAIServingChat):
    """vLLM's /v1/chat/completions serving, with dlora's model check and template time bound."""

    async def render_chat_request(self, request: ChatCompletionRequest):
        try:
            return await super().render_chat_request(request)
        except TimeoutError:
            return render_timed_out("messages")


class ChatTokenizedResponsesRequest(ResponsesRequest):
    """A Responses request whose rendered conversation is tokenized as vLLM tokenizes a chat's:
    the chat template writes every special token itself."""

    def build_tok_params(self, model_config: ModelConfig) -> TokenizeParams:
        return replace(super().build_tok_params(model_config), add_special_tokens=False)

    @classmethod
    def of(cls, request: ResponsesRequest) -> ChatTokenizedResponsesRequest:
        """The same (validated) request, fields and extra fields as they are."""
        fields = {**request.__dict__, **(request.__pydantic_extra__ or {})}
        return cls.model_construct(_fields_set=set(request.model_fields_set), **fields)


class DloraResponses(_DloraModelCheck, OpenAIServingResponses):
    """vLLM's /v1/responses serving, with dlora's model check, request ids, chat tokenization and
    template time bound."""

    async def _render_resolved_response_inputs(self, *args: Any, **kwargs: Any):
        try:
            return await super()._render_resolved_response_inputs(*args, **kwargs)
        except TimeoutError:
            return render_timed_out("input")

    async def create_responses(self, request: ResponsesRequest, raw_request: Request | None = None):
        # vLLM names the engine request (and the response) after the body's `request_id`; the router
        # keys requests by it, so a client's own id could collide with another client's request. The
        # server's id instead (admission put it in X-Request-Id, and answers with it).
        chat_tokenized = ChatTokenizedResponsesRequest.of(request)
        chat_tokenized.request_id = f"resp_{self._base_request_id(raw_request)}"
        return await super().create_responses(chat_tokenized, raw_request)


class DloraTokenization(_DloraModelCheck, ServingTokenization):
    """vLLM's /tokenize and /detokenize, with dlora's model check."""


@dataclass(frozen=True)
class Frontend:
    """vLLM's serving objects over one server's router and adapters."""

    client: RouterEngineClient
    models: DloraServingModels
    completion: DloraCompletion
    chat: DloraChat
    responses: DloraResponses
    tokenization: DloraTokenization

    async def answer(self, url: str, body: dict, request_id: str, priority: int) -> dict:
        """A whole (non-streamed) response body for `body` posted to `url` without HTTP (a batch
        line), as vLLM's run-batch gets one; `priority` and `request_id` replace the body's own.
        Raises pydantic's ValidationError for a body the route would refuse, and APIError for the
        error response the route would send."""
        update = {"stream": False, "priority": priority, "request_id": request_id}
        result: Any
        try:
            if url == "/v1/completions":
                completion = CompletionRequest.model_validate(body).model_copy(update=update)
                result = await self.completion.create_completion(completion)
            else:
                chat = ChatCompletionRequest.model_validate(body).model_copy(update=update)
                result = await self.chat.create_chat_completion(chat)
        except ValidationError:
            raise
        except Exception as e:
            result = error_of(e, request_id)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # vLLM answers a cancelled request as a client's disconnect (an error response); a line is
            # cancelled when its batch or the server stops, and must run again, not fail.
            raise asyncio.CancelledError
        if isinstance(result, ErrorResponse):
            raise APIError(result.error.code, result.error.message, result.error.param)
        return result.model_dump()  # a whole response: `stream` is off


# What vLLM's own exception handlers answer with the error's status and (sanitised) message; any
# other exception is the server's fault, and its text stays in the log.
CLIENT_ERRORS = (VLLMError, ValueError, TypeError, OverflowError, NotImplementedError)


def error_of(exc: Exception, context: str) -> ErrorResponse:
    """The error response vLLM's server sends for `exc`, without the text of unexpected ones."""
    if isinstance(exc, CLIENT_ERRORS):
        return create_error_response(exc)
    log.error("%s failed", context, exc_info=exc)
    return create_error_response("internal server error", "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)


def build(state: ServerState) -> Frontend:
    """vLLM's serving objects over `state`'s router and adapters, configured from its config."""
    cfg = state.cfg
    os.environ[RENDER_TIMEOUT_ENV] = str(cfg.server.template_timeout_s)
    vllm_config = engine_less_vllm_config(cfg, state.model_path, state.base_model_name)
    renderer = renderer_from_config(vllm_config)
    server = cfg.server
    # What vLLM's server builds from its flags of the same names (--chat-template, --tool-call-parser,
    # --enable-auto-tool-choice, --reasoning-parser, --trust-request-chat-template).
    chat_options: dict[str, Any] = dict(
        chat_template=load_chat_template(server.chat_template),  # None: the model's own
        chat_template_content_format=CONTENT_FORMAT,
        # A request's own template is code the server would run: only where the operator allows it.
        trust_request_chat_template=server.trust_request_chat_template,
    )
    parsers: dict[str, Any] = dict(
        enable_auto_tools=server.enable_auto_tool_choice,
        tool_parser=server.tool_call_parser,
        reasoning_parser=server.reasoning_parser or "",
    )
    online = OnlineRenderer(vllm_config.model_config, renderer, request_logger=None, **chat_options, **parsers)
    client = RouterEngineClient(state, vllm_config, renderer)
    models = DloraServingModels(
        client, state.model_path, state.base_model_name, state.adapters, show_paths=server.show_model_paths
    )
    details: dict[str, Any] = dict(enable_prompt_tokens_details=server.enable_prompt_tokens_details)
    completion = DloraCompletion(client, models, online_renderer=online, request_logger=None, **details)
    chat = DloraChat(
        client,
        models,
        RESPONSE_ROLE,
        online_renderer=online,
        request_logger=None,
        **chat_options,
        **parsers,
        **details,
    )
    # What vLLM's server builds it from: chat's flags, less the request templates it has no field for.
    responses = DloraResponses(
        client,
        models,
        online,
        request_logger=None,
        chat_template=chat_options["chat_template"],
        chat_template_content_format=CONTENT_FORMAT,
        **parsers,
        **details,
    )
    tokenization = DloraTokenization(models, online, **chat_options)
    return Frontend(client, models, completion, chat, responses, tokenization)


def install(app: FastAPI) -> None:
    """Mount vLLM's routes (its own route functions); their serving objects are set by `start` once
    the server state exists."""
    from vllm.entrypoints.openai.chat_completion.api_router import create_chat_completion
    from vllm.entrypoints.openai.completion.api_router import create_completion
    from vllm.entrypoints.openai.models.api_router import show_available_models
    from vllm.entrypoints.openai.responses.api_router import cancel_responses, create_responses, retrieve_responses
    from vllm.entrypoints.serve.tokenize.api_router import router as tokenize_router
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    async def vllm_error(request: Request, exc: Exception) -> JSONResponse:
        err = error_of(exc, f"{request.method} {request.url.path}")
        return JSONResponse(err.model_dump(), status_code=err.error.code)

    for kind in CLIENT_ERRORS:
        app.add_exception_handler(kind, vllm_error)
    inference = [Depends(require_api_key), Depends(validate_json_request)]
    app.add_api_route("/v1/completions", create_completion, methods=["POST"], dependencies=inference)
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], dependencies=inference)
    app.add_api_route("/v1/responses", create_responses, methods=["POST"], dependencies=inference)
    # vLLM's routes for stored responses, under the key like every /v1 route: with nothing stored
    # they answer vLLM's 404 for any id.
    keyed = [Depends(require_api_key)]
    app.add_api_route("/v1/responses/{response_id}", retrieve_responses, methods=["GET"], dependencies=keyed)
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel_responses, methods=["POST"], dependencies=keyed)
    app.add_api_route("/v1/models", show_available_models, methods=["GET"], dependencies=keyed)
    app.include_router(tokenize_router)


def start(app: FastAPI, state: ServerState) -> None:
    """Hand vLLM's routes the serving objects they look up on `app.state`."""
    frontend = state.frontend
    assert frontend is not None, "build_state builds the frontend"
    app.state.openai_serving_models = frontend.models
    app.state.openai_serving_completion = frontend.completion
    app.state.openai_serving_chat = frontend.chat
    app.state.openai_serving_responses = frontend.responses
    app.state.serving_tokenization = frontend.tokenization

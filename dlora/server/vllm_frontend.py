"""vLLM's own OpenAI serving classes in dlora's API process, over dlora's adapters.

vLLM builds its frontend from a `VllmConfig`, a renderer (tokenizer and chat template) and a
model registry; none of them needs a local engine (vLLM's GPU-less render server builds them the
same way). dlora builds them once at start from its config, and serves vLLM's own routes with
them, so that request fields, validation and response shapes are vLLM's, not a re-typed copy:

- `/tokenize` and `/detokenize` (vLLM's `ServingTokenization`), for the base model and every
  adapter (adapters share the base model's tokenizer).

The registry (`DloraModelRegistry`) is a view over dlora's adapter manager: a name is served when
it is the base model or an adapter dlora has registered, or can resolve (`server.resolve_adapters`),
with dlora's own answers for adapters that exist but cannot be served.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.lora.request import LoRARequest
from vllm.renderers import renderer_from_config
from vllm.renderers.online_renderer import OnlineRenderer

from dlora.adapters.lifecycle import AdapterManager
from dlora.replica.engine import engine_kwargs
from dlora.server.errors import APIError, error_body
from dlora.server.generation import lookup_adapter

if TYPE_CHECKING:
    from fastapi import FastAPI

    from dlora.config import DloraConfig
    from dlora.server.state import ServerState

log = logging.getLogger(__name__)


def engine_less_vllm_config(cfg: DloraConfig, model_path: str, served_name: str) -> VllmConfig:
    """The replicas' own engine arguments (dlora.replica.engine) as a `VllmConfig` for the frontend:
    the same model config, and no engine behind it."""
    args = AsyncEngineArgs(**engine_kwargs(cfg, model_path), served_model_name=[served_name])
    model_config = args.create_model_config()
    model_config.quantization = None  # the frontend runs no kernels (as vLLM's render server)
    return VllmConfig(model_config=model_config, structured_outputs_config=args.create_structured_outputs_config())


class DloraModelRegistry(OpenAIModelRegistry):
    """vLLM's model registry over dlora's: the base model, then every adapter dlora serves."""

    def __init__(self, vllm_config: VllmConfig, model_path: str, served_name: str, adapters: AdapterManager):
        super().__init__(vllm_config.model_config, [BaseModelPath(name=served_name, model_path=model_path)])
        self._adapters = adapters

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        """The registered adapters as vLLM names them (read at each request: the registry changes)."""
        return {
            rec.name: LoRARequest(lora_name=rec.name, lora_int_id=rec.int_id, lora_path=rec.path)
            for rec in self._adapters.registry.all()
        }

    @lora_requests.setter
    def lora_requests(self, _value: dict[str, LoRARequest]) -> None:
        """The base class sets an empty dict; dlora's registry is the only source."""

    def model_name(self, lora_request: LoRARequest | None = None) -> str:
        """The name a response carries: the adapter's public name, else the base model's."""
        return lora_request.lora_name if lora_request is not None else super().model_name()

    async def check_model(self, model_name: str | None) -> ErrorResponse | None:
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


def tokenization(state: ServerState) -> ServingTokenization:
    """vLLM's /tokenize and /detokenize over the server's model and adapters."""
    vllm_config = engine_less_vllm_config(state.cfg, state.model_path, state.base_model_name)
    models = DloraModelRegistry(vllm_config, state.model_path, state.base_model_name, state.adapters)
    renderer = OnlineRenderer(
        vllm_config.model_config,
        renderer_from_config(vllm_config),
        request_logger=None,
        chat_template=None,  # the model's own
        chat_template_content_format="auto",
        # A request's own template is code the server would run: only where the operator allows it.
        trust_request_chat_template=state.cfg.server.trust_request_chat_template,
    )
    return ServingTokenization(
        models,
        renderer,
        chat_template=None,
        chat_template_content_format="auto",
        trust_request_chat_template=state.cfg.server.trust_request_chat_template,
    )


def install(app: FastAPI) -> None:
    """Mount vLLM's routes; their serving objects are set by `start` once the server state exists."""
    from vllm.entrypoints.serve.tokenize.api_router import router as tokenize_router

    app.include_router(tokenize_router)


def start(app: FastAPI, state: ServerState) -> None:
    app.state.serving_tokenization = tokenization(state)

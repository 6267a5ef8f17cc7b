"""What `dlora serve` and `dlora batch run` check before anything slow starts: the model, the
configured adapters, the frontend's parsers and templates, and that the KV cache fits the host.
A mistake is one `ConfigError` line rather than a failed start minutes later."""

from __future__ import annotations

import os
from pathlib import Path

from dlora import config as config_mod


def check_before_start(cfg: config_mod.DloraConfig) -> config_mod.DloraConfig:
    """Resolve the model and validate configured adapters now, so mistakes are one-line errors
    instead of a failed start minutes later."""
    from dlora.adapters.validate import AdapterValidationError, BaseModelShapes, inspect_adapter
    from dlora.engine_ext import lora_backend
    from dlora.models.smollm2 import resolve_model_path

    lora_backend.check_config(cfg)
    check_credentials(cfg)
    check_kv_cache_fits(cfg)
    check_frontend_options(cfg)
    try:
        model_path = resolve_model_path(cfg.model.path)
    except (ValueError, FileNotFoundError) as e:
        raise config_mod.ConfigError(f"model.path={cfg.model.path!r}: {e}") from None
    try:
        base = BaseModelShapes.from_model_dir(model_path)
    except (OSError, ValueError, KeyError, TypeError) as e:  # no/unreadable/incomplete config.json
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise config_mod.ConfigError(
            f"model.path={cfg.model.path!r}: not a Hugging Face model directory (config.json: {what})"
        ) from None
    for spec in cfg.adapters:
        try:
            inspect_adapter(spec.path, base, cfg.engine.max_lora_rank)
        except AdapterValidationError as e:
            raise config_mod.ConfigError(f"adapters: {spec.name!r} ({spec.path}): {e}") from None
    return config_mod.override(cfg, {"model.path": model_path})


def check_credentials(cfg: config_mod.DloraConfig) -> None:
    """The admin token must not also be an API key: whoever holds that key would administer the
    server (load and unload adapters, see every owner's files and batches)."""
    token = cfg.admin_token
    if token is not None and token in cfg.api_key:
        raise config_mod.ConfigError(
            "server.admin_token (or DLORA_ADMIN_TOKEN) equals one of server.api_key (or DLORA_API_KEY): "
            "that key would also be the admin's; choose a different admin token"
        )


def check_frontend_options(cfg: config_mod.DloraConfig) -> None:
    """The parsers, chat template and generation config the vLLM frontend will load, checked now by
    vLLM's own rules and registries, so that a misspelt name is a one-line error at start."""
    server = cfg.server
    if server.tool_call_parser is not None:
        from vllm.tool_parsers import ToolParserManager

        tool_parsers = ToolParserManager.list_registered()
        check_registered("server.tool_call_parser", server.tool_call_parser, tool_parsers, "tool call parser")
    if server.reasoning_parser is not None:
        from vllm.reasoning import ReasoningParserManager

        reasoning_parsers = ReasoningParserManager.list_registered()
        check_registered("server.reasoning_parser", server.reasoning_parser, reasoning_parsers, "reasoning parser")
    if server.chat_template is not None:
        check_chat_template(server.chat_template)
    check_generation_config(cfg.model.generation_config)


def check_registered(key: str, name: str, registered: list[str], what: str) -> None:
    if name not in registered:
        raise config_mod.ConfigError(f"{key}={name!r}: vLLM has no such {what}; it has {', '.join(sorted(registered))}")


def check_chat_template(template: str) -> None:
    """vLLM's test: a value without `{`, `}` or a newline names a file (or one of vLLM's own templates)."""
    from vllm.exceptions import VLLMError
    from vllm.renderers.chat_utils import validate_chat_template

    try:
        validate_chat_template(template)
    except (VLLMError, OSError) as e:
        raise config_mod.ConfigError(f"server.chat_template={template!r}: {e}") from None


def check_generation_config(value: str) -> None:
    if value not in ("auto", "vllm") and not Path(value).is_dir():
        raise config_mod.ConfigError(
            f"model.generation_config={value!r}: must be auto, vllm or a directory holding generation_config.json"
        )


def total_memory_bytes() -> int | None:
    """This machine's physical memory (None when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def check_kv_cache_fits(cfg: config_mod.DloraConfig) -> None:
    """A CPU replica allocates engine.kv_cache_space_gib for its KV cache (VLLM_CPU_KVCACHE_SPACE) and
    vLLM refuses, deep inside the replica, when that is more than the memory available; more than the
    whole machine can never work, so refuse it here. Only for a local Ray cluster (a remote one's
    nodes are unknown until joined) without GPUs (GPU engines ignore the setting)."""
    total = total_memory_bytes()
    need = cfg.engine.kv_cache_space_gib * 2**30
    if cfg.cluster.ray_address is not None or total is None or need <= total:
        return
    import torch

    if torch.cuda.is_available():
        return
    raise config_mod.ConfigError(
        f"engine.kv_cache_space_gib={cfg.engine.kv_cache_space_gib}: more than this machine's memory "
        f"({total / 2**30:.1f} GiB); each CPU replica allocates this much for its KV cache"
    )

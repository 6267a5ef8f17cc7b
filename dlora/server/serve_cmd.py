"""`dlora serve`: load the config, start Ray + replicas, serve HTTP with uvicorn."""

from __future__ import annotations

import argparse
import logging

from dlora import config as config_mod


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Start Ray, the replica engines and the HTTP server.")
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("--host", dest="server.host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", dest="server.port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--model", dest="model.path", help="model directory or auto:<name>")
    p.add_argument("--served-model-name", dest="model.served_name")
    p.add_argument("--dtype", dest="model.dtype")
    p.add_argument("--max-model-len", dest="model.max_model_len", type=int)
    p.add_argument("--max-loras", dest="engine.max_loras", type=int)
    p.add_argument("--max-lora-rank", dest="engine.max_lora_rank", type=int)
    p.add_argument("--max-cpu-loras", dest="engine.max_cpu_loras", type=int)
    p.add_argument("--kv-cache-space-gib", dest="engine.kv_cache_space_gib", type=int)
    p.add_argument("--max-num-seqs", dest="engine.max_num_seqs", type=int)
    p.add_argument("--num-replicas", dest="cluster.num_replicas", type=int)
    p.add_argument("--ray-address", dest="cluster.ray_address")
    p.add_argument("--admin-token", dest="server.admin_token")
    p.add_argument("--state-dir", dest="server.state_dir")
    p.set_defaults(func=run)


def load_config(args: argparse.Namespace) -> config_mod.DloraConfig:
    cfg = config_mod.load(args.config)
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    return config_mod.override(cfg, overrides)


def check_before_start(cfg: config_mod.DloraConfig) -> config_mod.DloraConfig:
    """Resolve the model and validate configured adapters now, so mistakes are one-line errors
    instead of a failed start minutes later."""
    from dlora.adapters.validate import AdapterValidationError, BaseModelShapes, inspect_adapter
    from dlora.models.smollm2 import resolve_model_path
    from dlora.replica import lora_backend

    lora_backend.check_config(cfg)
    try:
        model_path = resolve_model_path(cfg.model.path)
    except (ValueError, FileNotFoundError) as e:
        raise config_mod.ConfigError(f"model.path={cfg.model.path!r}: {e}") from None
    base = BaseModelShapes.from_model_dir(model_path)
    for spec in cfg.adapters:
        try:
            inspect_adapter(spec.path, base, cfg.engine.max_lora_rank)
        except AdapterValidationError as e:
            raise config_mod.ConfigError(f"adapters: {spec.name!r} ({spec.path}): {e}") from None
    return config_mod.override(cfg, {"model.path": model_path})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dlora.server.app import create_app
    from dlora.server.state import build_state

    cfg = check_before_start(load_config(args))
    logging.basicConfig(level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(lambda: build_state(cfg))
    uvicorn.run(app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
                timeout_graceful_shutdown=10)
    return 0

"""`dlora serve`'s command line: vLLM's flags where the two share one, each setting a config key.

`load_config` reads the YAML file (or the defaults) and puts the flags on top; any `vllm serve`
flag dlora does not take is refused by name (`explain_unrecognized`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dlora import config as config_mod

log = logging.getLogger(__name__)


def add_vllm_flags(g) -> None:
    """vLLM's flags, each setting the config key that is its `dest` (a dest without a dot is turned
    into config values by `vllm_form_overrides`). Booleans take vLLM's --x/--no-x forms and default to
    None, so that leaving a flag out keeps the YAML's value."""
    flag = argparse.BooleanOptionalAction
    g.add_argument("--model", dest="model.path", help="model directory or auto:<name>")
    g.add_argument("--served-model-name", dest="served_model_names", nargs="+", action="extend", metavar="NAME")
    g.add_argument("--dtype", dest="model.dtype", type=vllm_dtype)
    g.add_argument("--max-model-len", dest="model.max_model_len", type=human_readable_int, help="e.g. 4096, 4k, 4K")
    g.add_argument("--seed", dest="model.seed", type=int)
    g.add_argument("--generation-config", dest="model.generation_config", help="auto, vllm or a directory")
    g.add_argument("--enable-lora", action="store_true", help="accepted: dlora always serves adapters")
    g.add_argument(
        "--lora-modules",
        dest="lora_modules",
        nargs="+",
        action="extend",
        metavar="MODULE",
        help='name=path or {"name": ..., "path": ..., "base_model_name": ...}; added to the adapters: list',
    )
    g.add_argument("--max-loras", dest="engine.max_loras", type=int)
    g.add_argument("--max-lora-rank", dest="engine.max_lora_rank", type=int)
    g.add_argument("--max-cpu-loras", dest="engine.max_cpu_loras", type=int)
    g.add_argument("--max-num-seqs", dest="engine.max_num_seqs", type=int)
    g.add_argument("--enable-prefix-caching", dest="engine.enable_prefix_caching", action=flag)
    g.add_argument(
        "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, help="1 only: one device per replica"
    )
    g.add_argument("--host", dest="server.host", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", dest="server.port", type=int, help="HTTP port (default 8000)")
    g.add_argument("--api-key", dest="api_keys", nargs="+", action="extend", metavar="KEY")
    g.add_argument("--chat-template", dest="server.chat_template", help="a template file or the template itself")
    g.add_argument("--trust-request-chat-template", dest="server.trust_request_chat_template", action=flag)
    g.add_argument("--tool-call-parser", dest="server.tool_call_parser")
    g.add_argument("--enable-auto-tool-choice", dest="server.enable_auto_tool_choice", action=flag)
    g.add_argument("--enable-prompt-tokens-details", dest="server.enable_prompt_tokens_details", action=flag)
    g.add_argument("--reasoning-parser", dest="server.reasoning_parser")
    g.add_argument(
        "--structured-outputs-config",
        dest="structured_outputs_config",
        metavar="JSON",
        help='{"backend": ..., "disable_any_whitespace": ...}; or each key as --structured-outputs-config.KEY',
    )
    g.add_argument(
        "--structured-outputs-config.backend",
        dest="engine.structured_outputs_backend",
        choices=config_mod.STRUCTURED_OUTPUTS_BACKENDS,
    )
    g.add_argument(
        "--structured-outputs-config.disable_any_whitespace",
        dest="engine.structured_outputs_disable_any_whitespace",
        type=true_or_false,
        nargs="?",
        const=True,
        metavar="true|false",
    )
    g.add_argument(
        "--log-level",
        dest="server.log_level",
        type=str.lower,  # vLLM writes them in capitals
        choices=config_mod.LOG_LEVELS,
        help="log level (default info); debug also logs the traceback of a failed start",
    )


def true_or_false(value: str) -> bool:
    """A boolean as vLLM's dotted config flags take it."""
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"


# vLLM's --dtype names that dlora's model.dtype spells otherwise.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def vllm_dtype(value: str) -> str:
    return _DTYPE_ALIASES.get(value, value)


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """A whole number as vLLM's --max-model-len takes it: 4096, 4k (x1000), 25.6k, 4K (x1024)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
    if m is None:
        return int(value)
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    return int(number) * _BINARY[suffix]  # vLLM takes no fraction of a binary unit either


def load_config(args: argparse.Namespace) -> config_mod.DloraConfig:
    """The YAML file (or the defaults), then the flags given on top of it."""
    cfg = config_mod.load(args.config)
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    overrides.update(vllm_form_overrides(args))
    cfg = config_mod.override(cfg, overrides)
    return add_lora_modules(cfg, parse_lora_modules(getattr(args, "lora_modules", None) or ()))


def vllm_form_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config values from the flags that take vLLM's forms rather than one config value each.
    `dlora batch run` shares load_config without these flags, hence getattr."""
    out: dict[str, Any] = {"model.path": model_path(getattr(args, "model_tag", None), vars(args).get("model.path"))}
    names = getattr(args, "served_model_names", None)
    if names:
        if len(names) > 1:
            raise config_mod.ConfigError(
                f"--served-model-name {' '.join(names)}: dlora serves the base model under one name"
            )
        out["model.served_name"] = names[0]
    keys = getattr(args, "api_keys", None)
    if keys:
        out["server.api_key"] = tuple(keys)
    out.update(structured_outputs_overrides(getattr(args, "structured_outputs_config", None)))
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp != 1:
        raise config_mod.ConfigError(
            f"--tensor-parallel-size {tp}: dlora runs each replica on one device; "
            "serve on more devices with more replicas (--num-replicas)"
        )
    return out


# vLLM's --structured-outputs-config keys dlora takes, and the config keys they set.
STRUCTURED_OUTPUTS_KEYS = {
    "backend": "engine.structured_outputs_backend",
    "disable_any_whitespace": "engine.structured_outputs_disable_any_whitespace",
}


def structured_outputs_overrides(text: str | None) -> dict[str, Any]:
    """Config values from vLLM's JSON form of --structured-outputs-config."""
    if text is None:
        return {}
    try:
        fields = json.loads(text)
    except json.JSONDecodeError:
        fields = None
    if not isinstance(fields, dict):
        raise config_mod.ConfigError(f"--structured-outputs-config {text!r}: not a JSON object")
    unknown = sorted(set(fields) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise config_mod.ConfigError(
            f"--structured-outputs-config: dlora does not take {', '.join(unknown)} "
            f"(it takes {', '.join(STRUCTURED_OUTPUTS_KEYS)})"
        )
    return {STRUCTURED_OUTPUTS_KEYS[k]: v for k, v in fields.items()}


def model_path(positional: str | None, flag: str | None) -> str | None:
    """The model from `dlora serve MODEL` (vLLM's form) or --model; both may be given if they agree."""
    if positional is not None and flag is not None and positional != flag:
        raise config_mod.ConfigError(f"MODEL {positional!r} and --model {flag!r} differ: give the model once")
    return positional if positional is not None else flag


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One item of vLLM's --lora-modules."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: Iterable[str]) -> list[LoraModule]:
    """vLLM's --lora-modules items, read as vLLM reads them: `name=path`, or a JSON object with
    name, path and optionally base_model_name. Empty items are skipped, as vLLM does."""
    return [parse_lora_module(item) for item in items if item]


def parse_lora_module(item: str) -> LoraModule:
    if "=" in item and "," not in item:  # vLLM's test for the name=path form
        name, path = item.split("=", 1)
        fields: Any = {"name": name, "path": path}
    else:
        try:
            fields = json.loads(item)
        except json.JSONDecodeError:
            raise config_mod.ConfigError(f"--lora-modules {item!r}: neither name=path nor a JSON object") from None
    known = {f.name for f in dataclasses.fields(LoraModule)}
    if not isinstance(fields, dict) or not {"name", "path"} <= set(fields) or not set(fields) <= known:
        raise config_mod.ConfigError(
            f"--lora-modules {item!r}: a JSON item is an object with name, path and optionally base_model_name"
        )
    module = LoraModule(**fields)
    if not all(isinstance(v, str) and v for v in (module.name, module.path)):
        raise config_mod.ConfigError(f"--lora-modules {item!r}: name and path must be non-empty strings")
    return module


def add_lora_modules(cfg: config_mod.DloraConfig, modules: list[LoraModule]) -> config_mod.DloraConfig:
    """The --lora-modules adapters after the YAML's `adapters:` list. A module's path is relative to
    the working directory, as in vLLM."""
    served = served_names(cfg)
    taken = {a.name for a in cfg.adapters}
    added = []
    for m in modules:
        if m.base_model_name is not None and m.base_model_name not in served:
            raise config_mod.ConfigError(
                f"--lora-modules {m.name}: base_model_name {m.base_model_name!r} is not the served model "
                f"({' or '.join(repr(n) for n in sorted(served))}); dlora serves adapters of one base model"
            )
        if m.name in taken:
            raise config_mod.ConfigError(f"--lora-modules {m.name}: an adapter of that name is already configured")
        taken.add(m.name)
        added.append(config_mod.AdapterSpec(m.name, os.path.abspath(os.path.expanduser(m.path))))
    return dataclasses.replace(cfg, adapters=cfg.adapters + tuple(added)) if added else cfg


def served_names(cfg: config_mod.DloraConfig) -> set[str]:
    """The names a --lora-modules base_model_name may give the base model by: model.served_name, or
    without one what names the model before it is resolved (the path as given, as vLLM names it,
    and its directory's name, as dlora serves it)."""
    if cfg.model.served_name is not None:
        return {cfg.model.served_name}
    return {cfg.model.path, Path(cfg.model.path).name}


def explain_unrecognized(extra: list[str], own: frozenset[str] = frozenset()) -> str | None:
    """The error for arguments `dlora serve` did not take: the first flag that is one of its `own`
    written with underscores (vLLM's parser takes those, argparse does not), else the first that is
    a flag of `vllm serve`, named as one dlora does not support. None leaves argparse's error (a
    flag neither knows, or vLLM's parser cannot be built)."""
    flags = [token.split("=", 1)[0] for token in extra if token.startswith("-")]
    for flag in flags:
        if "_" in flag and flag.replace("_", "-") in own:
            return f"{flag}: dlora takes it as {flag.replace('_', '-')}"
    if not flags:
        return None
    try:
        known = vllm_serve_flags()
    except Exception:  # only the wording of the error depends on it: fall back to argparse's
        log.debug("could not build vLLM's parser", exc_info=True)
        return None
    for flag in flags:
        name = vllm_flag_name(flag, known)
        if name is not None:
            return f"vLLM's {name} is not supported by dlora"
    return None


def vllm_flag_name(flag: str, known: frozenset[str]) -> str | None:
    """The vLLM flag that a flag given on the command line (without its `=value`) is, as vLLM's
    parser reads it, or None: underscores are dashes (--max_num_batched_tokens), `--x.key` and
    `--x.key+` set a key of the JSON flag --x, and -O, -O3 are vLLM's --optimization-level."""
    if flag.startswith("--"):
        flag = "--" + flag[2:].split(".", 1)[0].rstrip("+").replace("_", "-")
    elif flag.startswith("-O") and "--optimization-level" in known:  # rewritten before vLLM's argparse
        return "-O"
    return flag if flag in known else None


@functools.cache
def vllm_serve_flags() -> frozenset[str]:
    """Every option string `vllm serve` takes, read from vLLM's own parser. Imported only when an
    unknown flag is given: it takes seconds."""
    # vLLM warns about the machine while it is imported (on stderr, before its own logging is set
    # up); here its parser is all that is wanted, and the error must stay one line.
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    finally:
        logging.disable(previous)
    return frozenset(option for action in parser._actions for option in action.option_strings)

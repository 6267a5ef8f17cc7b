"""/v1/models is vLLM's own listing (`OpenAIServingModels.show_available_models`) over dlora's
adapter registry (`DloraServingModels`): the base model, then every registered adapter in
registration order, each as vLLM lists a --lora-modules adapter (with `server.show_model_paths`;
without it, each card's `root` is its own name). A listing reads the registry only:
thousands of adapters whose files are nowhere to be found are listed all the same (nothing per
adapter touches the disk, a replica or a resolver)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dlora.adapters.registry import AdapterRegistry
from dlora.adapters.validate import AdapterInfo
from dlora.server.vllm_frontend import DloraServingModels

ADAPTERS = 2000


def listing(show_paths: bool) -> list[dict]:
    registry = AdapterRegistry(None)
    for i in range(ADAPTERS):
        info = AdapterInfo(path=f"/nowhere/a{i}", rank=8, alpha=16.0, target_modules=("q_proj",), size_bytes=1)
        registry.add(f"a{i}", info)
    registry.remove("a7")  # a removed adapter is listed no more
    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512), renderer=None, input_processor=None)
    adapters = SimpleNamespace(registry=registry)
    models = DloraServingModels(engine, "/models/base", "base", adapters, show_paths)  # type: ignore[arg-type]
    return asyncio.run(models.show_available_models()).model_dump()["data"]


def test_the_base_model_then_every_registered_adapter_as_vllm_lists_them():
    cards = listing(show_paths=True)
    base, *listed = cards
    assert (base["id"], base["root"], base["parent"], base["max_model_len"]) == ("base", "/models/base", None, 512)
    want = [(f"a{i}", f"/nowhere/a{i}", "base") for i in range(ADAPTERS) if i != 7]
    assert [(c["id"], c["root"], c["parent"]) for c in listed] == want
    assert all(c["object"] == "model" and c["owned_by"] == "vllm" for c in cards)


def test_without_show_model_paths_no_card_names_a_path():
    cards = listing(show_paths=False)
    assert [(c["id"], c["root"]) for c in cards] == [("base", "base")] + [
        (f"a{i}", f"a{i}") for i in range(ADAPTERS) if i != 7
    ]
    assert [c["parent"] for c in cards] == [None] + ["base"] * (ADAPTERS - 1)

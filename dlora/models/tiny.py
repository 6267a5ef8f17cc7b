"""A deterministic tiny Llama and LoRA adapters, built offline in seconds, for tests.

Tests compare our serving path token-for-token against Hugging Face + PEFT, so the fixture model
must be (1) buildable with no hub access, (2) identical for a given seed, and (3) *decisive*: a
random network usually has near-tied top logits, and then greedy output flips with harmless
numeric differences (batch shape, kernel order). We make every greedy decision clear by giving
the lm_head a large init, so the top-1 logit leads the runner-up by a wide margin, and save in
float32 so resumed/batched runs are bit-comparable.

Layout of a built model directory:

    base/        config.json, model.safetensors (fp32), tokenizer.json, chat_template.jinja, ...
    a0 .. a3/    PEFT adapters (adapter_config.json + adapter_model.safetensors)
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dlora import env
from dlora.models.atomic import build_atomically, is_complete, read_marker

TINY_VERSION = "tiny-v1"
VOCAB_SIZE = 2048
HIDDEN_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4  # head_dim 64, a size every attention backend supports
NUM_KV_HEADS = 2  # grouped-query attention, like SmolLM2
LAYER_INIT_STD = 0.06  # large enough that attention (and so q/k/v/o adapters) shapes the output
LM_HEAD_INIT_STD = 8.0  # logit std ~130: top-1 leads by a wide margin (see module docstring)
LORA_B_STD = 0.05
CORPUS_FILES = 60
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """Shape of one generated adapter; mixed ranks and targets exercise the batched LoRA path."""

    name: str
    rank: int
    target_modules: tuple[str, ...]


ADAPTER_SPECS = (
    AdapterSpec("a0", 8, ATTENTION),
    AdapterSpec("a1", 4, ATTENTION),
    AdapterSpec("a2", 8, ATTENTION + MLP),
    AdapterSpec("a3", 4, ATTENTION + MLP),
)


@dataclass(frozen=True)
class TestModel:
    """Where a built tiny model lives: the base directory and each adapter's directory."""

    __test__ = False  # not a pytest test class, despite the name

    base: Path
    adapters: dict[str, Path]

    @classmethod
    def at(cls, root: Path) -> TestModel:
        root = Path(root)
        return cls(base=root / "base", adapters={s.name: root / s.name for s in ADAPTER_SPECS})


def build_test_model(out_dir: Path, seed: int = 0) -> TestModel:
    """Write the tokenizer, base model and adapters into `out_dir` (which should be empty)."""
    out_dir = Path(out_dir)
    base_dir = out_dir / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(base_dir)
    model = build_base_model(tokenizer, seed)
    model.save_pretrained(base_dir)
    for index, spec in enumerate(ADAPTER_SPECS):
        peft_model = build_adapter(model, spec, seed * 1000 + index + 1)
        peft_model.save_pretrained(out_dir / spec.name, save_embedding_layers=False)
        _normalize_adapter_dir(out_dir / spec.name)
        model = peft_model.unload()  # the base model again, ready for the next adapter
    return TestModel.at(out_dir)


def _normalize_adapter_dir(adapter_dir: Path) -> None:
    """Make the saved adapter byte-identical across runs.

    PEFT stores `target_modules` as a set, so its JSON order follows PYTHONHASHSEED; sort it.
    The auto-generated model card is noise for a test fixture.
    """
    (adapter_dir / "README.md").unlink(missing_ok=True)
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def ensure_test_model(cache_root: Path | None = None, seed: int = 0) -> TestModel:
    """The tiny model for `seed` under `<cache>/test-models/`, built once (safe under races)."""
    root = (cache_root or env.cache_dir()) / "test-models" / f"{TINY_VERSION}-seed{seed}"
    return ensure_test_model_at(root, seed)


def ensure_test_model_at(root: Path, seed: int = 0) -> TestModel:
    """Build into `root` atomically unless a complete build for the same seed is already there."""
    root = Path(root)
    marker = {"kind": TINY_VERSION, "seed": seed}
    if is_complete(root) and read_marker(root) != marker:
        raise FileExistsError(f"{root} holds a different build {read_marker(root)}, not {marker}")
    build_atomically(root, lambda tmp: build_test_model(tmp, seed), marker)
    return TestModel.at(root)


# ----------------------------------------------------------------------------- tokenizer


def stdlib_corpus() -> Iterator[str]:
    """Text that exists on every machine with Python: the stdlib sources, in sorted order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py")))[:CORPUS_FILES]:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def build_tokenizer():
    """A byte-level BPE (any input encodes; no <unk> in practice) with a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(stdlib_corpus(), trainer=trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", core.token_to_id("<s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ----------------------------------------------------------------------------- model


def build_base_model(tokenizer, seed: int):
    """A random fp32 Llama whose greedy choices are decisive (see module docstring)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 2:
                std = LM_HEAD_INIT_STD if name == "lm_head.weight" else LAYER_INIT_STD
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def build_adapter(model, spec: AdapterSpec, seed: int):
    """Wrap `model` in a PEFT LoRA with seeded random A and B, so the adapter changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=2 * spec.rank,
        target_modules=list(spec.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_B_STD)
    peft_model.peft_config["default"].base_model_name_or_path = "dlora-tiny"
    return peft_model

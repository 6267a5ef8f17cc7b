"""The tiny test model: deterministic, offline, adapters that matter, decisive greedy choices."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dlora.models import tiny
from dlora.models.atomic import MARKER, read_marker

PROMPTS = ("Hello, how are you?", "def main():\n    return", "The quick brown fox", "Once upon a time")
GREEDY_STEPS = 32
# Reference build (seed 0): min gap 0.032 over these 640 decisions, median ~25, |logits| up to
# ~540. fp32 reordering noise at that scale is ~1e-4, so 0.01 is still far above it.
MIN_TOP2_GAP = 0.01
MIN_MEDIAN_TOP2_GAP = 5.0


def file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def load(model: tiny.TestModel, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model.base, dtype=torch.float32)
    return (PeftModel.from_pretrained(base, model.adapters[adapter]) if adapter else base).eval()


@torch.no_grad()
def greedy_with_gaps(lm, input_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation (EOS ignored) and, per step, top-1 minus top-2 logit."""
    ids = torch.tensor([input_ids])
    gaps = []
    for _ in range(steps):
        logits = lm(ids).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(input_ids) :].tolist(), gaps


@pytest.fixture(scope="module")
def greedy_runs(fresh_tiny) -> dict[str | None, dict[str, tuple[list[int], list[float]]]]:
    """Greedy outputs and gaps for base (None) and every adapter, on every prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fresh_tiny.base)
    runs = {}
    for adapter in (None, *fresh_tiny.adapters):
        lm = load(fresh_tiny, adapter)
        runs[adapter] = {p: greedy_with_gaps(lm, tok(p).input_ids, GREEDY_STEPS) for p in PROMPTS}
    return runs


def test_layout_and_fp32(fresh_tiny):
    assert sorted(fresh_tiny.adapters) == ["a0", "a1", "a2", "a3"]
    config = json.loads((fresh_tiny.base / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is False
    assert 128 <= config["hidden_size"] <= 256 and 2 <= config["num_hidden_layers"] <= 4
    with safe_open(fresh_tiny.base / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
        assert "lm_head.weight" in f.keys()
    assert (fresh_tiny.base / "chat_template.jinja").is_file()


def test_same_seed_same_bytes_other_seed_other_weights(fresh_tiny, tmp_path):
    again = tiny.build_test_model(tmp_path / "again", seed=0)
    root = fresh_tiny.base.parent
    expected = {k: v for k, v in file_hashes(root).items() if k != MARKER}
    assert file_hashes(again.base.parent) == expected

    other = tiny.build_test_model(tmp_path / "other", seed=1)
    other_hashes = file_hashes(other.base.parent)
    assert other_hashes["base/tokenizer.json"] == expected["base/tokenizer.json"]
    assert other_hashes["base/model.safetensors"] != expected["base/model.safetensors"]
    assert other_hashes["a0/adapter_model.safetensors"] != expected["a0/adapter_model.safetensors"]


def test_adapters_have_specified_ranks_and_targets(fresh_tiny):
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    mlp = {"gate_proj", "up_proj", "down_proj"}
    seen_ranks, with_mlp = set(), 0
    for name, path in fresh_tiny.adapters.items():
        config = json.loads((path / "adapter_config.json").read_text())
        targets = set(config["target_modules"])
        assert attention <= targets <= attention | mlp, name
        with_mlp += targets >= mlp
        rank = config["r"]
        seen_ranks.add(rank)
        assert config["lora_alpha"] == 2 * rank
        with safe_open(path / "adapter_model.safetensors", "pt") as f:
            modules = {k.split(".")[-3] for k in f.keys()}
            assert modules == targets, name
            for key in f.keys():
                tensor = f.get_tensor(key)
                assert tensor.shape[0 if "lora_A" in key else 1] == rank, key
                assert tensor.abs().max() > 0, f"{key} is zero: adapter would be a no-op"
    assert seen_ranks == {4, 8}
    assert with_mlp >= 1


def test_every_adapter_changes_greedy_output(greedy_runs):
    base = greedy_runs[None]
    for adapter, runs in greedy_runs.items():
        if adapter is None:
            continue
        changed = [p for p in PROMPTS if runs[p][0] != base[p][0]]
        assert changed == list(PROMPTS), f"{adapter} left {set(PROMPTS) - set(changed)} unchanged"


def test_greedy_decisions_have_large_margins(greedy_runs):
    gaps = sorted(g for runs in greedy_runs.values() for _, steps in runs.values() for g in steps)
    assert len(gaps) == 5 * len(PROMPTS) * GREEDY_STEPS
    assert gaps[0] >= MIN_TOP2_GAP, f"near-tie: min top-1/top-2 gap {gaps[0]:.2e}"
    assert gaps[len(gaps) // 2] >= MIN_MEDIAN_TOP2_GAP


def test_greedy_output_is_not_degenerate(greedy_runs):
    """A useful fixture produces varied text, not one token repeated."""
    for runs in greedy_runs.values():
        for tokens, _ in runs.values():
            assert len(set(tokens)) >= 8


def test_tokenizer_is_byte_level_with_chat_template(fresh_tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fresh_tiny.base)
    text = "naïve café ☕ — 東京 tab\tnewline\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s><|user|>\nhi\n<|assistant|>\n"


def test_ensure_builds_once_then_reuses(tmp_path):
    model = tiny.ensure_test_model(tmp_path, seed=2)
    root = tmp_path / "test-models" / "tiny-v1-seed2"
    assert model.base == root / "base"
    assert read_marker(root) == {"kind": "tiny-v1", "seed": 2}
    before = (model.base / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_test_model(tmp_path, seed=2) == model
    assert (model.base / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in root.parent.iterdir()] == ["tiny-v1-seed2"]  # no temp dirs left


def test_ensure_refuses_foreign_or_mismatched_dirs(tmp_path):
    tiny.ensure_test_model_at(tmp_path / "m", seed=0)
    with pytest.raises(FileExistsError, match="seed"):
        tiny.ensure_test_model_at(tmp_path / "m", seed=1)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a complete"):
        tiny.ensure_test_model_at(tmp_path / "junk", seed=0)
    assert (tmp_path / "junk" / "file.txt").read_text() == "mine"


def test_concurrent_ensure_is_safe(tmp_path, fresh_tiny):
    """Two processes racing to build the same model both succeed; one build survives intact,
    byte-identical to the one built in this process (so hash randomisation does not leak in)."""
    code = (
        "import sys, torch; torch.set_num_threads(1);"
        "from pathlib import Path; from dlora.models.tiny import ensure_test_model;"
        "print(ensure_test_model(Path(sys.argv[1]), 0).base)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    bases = {out.strip() for out, _ in results}
    root = tmp_path / "test-models" / "tiny-v1-seed0"
    assert bases == {str(root / "base")}
    assert [p.name for p in root.parent.iterdir()] == ["tiny-v1-seed0"]
    assert read_marker(root) == {"kind": "tiny-v1", "seed": 0}
    assert file_hashes(root) == file_hashes(fresh_tiny.base.parent)


def test_make_test_model_cli(tmp_path, capsys):
    from dlora.cli import UsageError

    parser = cli_parser()
    out_dir = tmp_path / "cli-model"
    args = parser.parse_args(["make-test-model", str(out_dir), "--seed", "0"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"base: {out_dir / 'base'}" in printed
    assert all(f"adapter {n}: {out_dir / n}" in printed for n in ("a0", "a1", "a2", "a3"))

    args = parser.parse_args(["make-test-model", str(out_dir), "--seed", "-3"])
    with pytest.raises(UsageError, match="-3"):
        args.func(args)
    args = parser.parse_args(["make-test-model", str(out_dir), "--seed", "5"])
    with pytest.raises(UsageError, match=str(out_dir)):
        args.func(args)


def cli_parser():
    import argparse

    from dlora.models import cli

    parser = argparse.ArgumentParser(prog="dlora")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser

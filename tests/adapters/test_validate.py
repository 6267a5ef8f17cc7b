import json
import shutil

import pytest

from dlora.adapters.validate import AdapterValidationError, BaseModelShapes, inspect_adapter, is_under_roots


def shapes(micro):
    return BaseModelShapes.from_model_dir(micro["base"])


def test_base_shapes_follow_gqa_config(micro):
    s = shapes(micro)
    assert s.num_layers == 2
    assert s.shapes["q_proj"] == (32, 32)
    assert s.shapes["k_proj"] == (32, 16)  # 2 kv heads x head_dim 8
    assert s.shapes["down_proj"] == (48, 32)


def test_lora_fraction_counts_the_adapters_multiply_adds_over_the_base_projections(micro):
    s = shapes(micro)
    base = 32 * 32 * 2 + 32 * 16 * 2 + 32 * 48 * 3  # q, o; k, v; gate, up, down: 7,680 per token
    assert s.lora_fraction(4, ("q_proj", "down_proj")) == pytest.approx(4 * (64 + 80) / base)
    assert s.lora_fraction(8, ("q_proj", "down_proj")) == pytest.approx(2 * s.lora_fraction(4, ("q_proj", "down_proj")))
    assert s.lora_fraction(4, ("q_proj", "lm_head", "q_proj")) == s.lora_fraction(4, ("q_proj",))  # unknown, repeated


def test_good_adapter_reports_rank_alpha_targets(micro):
    info = inspect_adapter(micro["good"], shapes(micro), max_rank=8)
    assert info.rank == 4 and info.alpha == 8.0
    assert info.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    assert info.size_bytes > 0


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json not found"),
        (lambda d: (d / "adapter_config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "adapter_model.safetensors").unlink(), "adapter_model.safetensors not found"),
        (
            lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage"),
            "not a readable safetensors",
        ),
        (lambda d: _truncate(d / "adapter_model.safetensors"), "not a readable safetensors"),
        (lambda d: _edit_config(d, use_dora=True), "DoRA"),
        (lambda d: _edit_config(d, peft_type="PREFIX_TUNING"), "not LORA"),
        (lambda d: _edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda d: _edit_config(d, r=8), "shape"),  # config says 8, tensors are rank 4
    ],
)
def test_bad_adapters_are_refused_with_reason(micro, tmp_path, mutate, reason):
    d = tmp_path / "a"
    shutil.copytree(micro["good"], d)
    mutate(d)
    with pytest.raises(AdapterValidationError, match=reason):
        inspect_adapter(d, shapes(micro), max_rank=8)


def _edit_config(d, **kv):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(kv)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _truncate(f):
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])


def test_missing_directory(micro, tmp_path):
    with pytest.raises(AdapterValidationError, match="not a directory"):
        inspect_adapter(tmp_path / "nope", shapes(micro), max_rank=8)


def test_adapter_for_another_model_is_refused(micro):
    with pytest.raises(AdapterValidationError, match="needs"):
        inspect_adapter(micro["wrong_shape"], shapes(micro), max_rank=8)


def test_rank_above_configured_max_is_refused(micro):
    with pytest.raises(AdapterValidationError, match="exceeds the configured max_lora_rank 8"):
        inspect_adapter(micro["big_rank"], shapes(micro), max_rank=8)
    assert inspect_adapter(micro["big_rank"], shapes(micro), max_rank=16).rank == 16


def test_layer_beyond_base_depth_is_refused(micro, tmp_path):
    cfg = json.loads((micro["base"] / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match="names layer 1"):
        inspect_adapter(micro["good"], BaseModelShapes.from_model_dir(tmp_path), max_rank=8)


def test_roots_follow_symlinks(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert is_under_roots(root / "a", (str(root),))
    assert not is_under_roots(root / "link", (str(root),))
    assert not is_under_roots(root / ".." / "outside", (str(root),))

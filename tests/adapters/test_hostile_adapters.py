"""Adapter files built to hurt the server are refused at validation, each with its reason:
non-finite or absurd lora_alpha, rank 0, NaN/Inf weights, pickle weights, symlinks out of the roots."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dlora.adapters.validate import (
    MAX_LORA_ALPHA,
    AdapterValidationError,
    BaseModelShapes,
    check_files,
    inspect_adapter,
)


def shapes(micro):
    return BaseModelShapes.from_model_dir(micro["base"])


@pytest.fixture
def adapter(micro, tmp_path):
    d = tmp_path / "root" / "a"
    shutil.copytree(micro["good"], d)
    return d


def set_config_text(d, key, literal):
    """Write `key` with a raw JSON literal (NaN, Infinity, 1e999 are what json.dumps cannot write)."""
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg[key] = "@@"
    (d / "adapter_config.json").write_text(json.dumps(cfg).replace('"@@"', literal))


def poison_tensor(d, value, which="lora_B"):
    f = d / "adapter_model.safetensors"
    tensors = load_file(str(f))
    key = next(k for k in sorted(tensors) if which in k)
    tensors[key][0, 0] = value
    save_file(tensors, str(f))
    return key


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "0", "-8", "4097", "1e9", "true", '"16"'])
def test_bad_lora_alpha_is_refused(micro, adapter, literal):
    set_config_text(adapter, "lora_alpha", literal)
    with pytest.raises(AdapterValidationError, match="lora_alpha"):
        inspect_adapter(adapter, shapes(micro), max_rank=8)


def test_alpha_at_the_bound_is_accepted(micro, adapter):
    set_config_text(adapter, "lora_alpha", str(int(MAX_LORA_ALPHA)))
    assert inspect_adapter(adapter, shapes(micro), max_rank=8).alpha == MAX_LORA_ALPHA


@pytest.mark.parametrize("literal", ["0", "null", "true", "4.0", "-4"])
def test_bad_rank_is_refused(micro, adapter, literal):
    set_config_text(adapter, "r", literal)
    with pytest.raises(AdapterValidationError, match="rank r="):
        inspect_adapter(adapter, shapes(micro), max_rank=8)


def test_missing_rank_is_refused(micro, adapter):
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    del cfg["r"]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match="rank r=None"):
        inspect_adapter(adapter, shapes(micro), max_rank=8)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_non_finite_weights_are_refused_naming_the_tensor(micro, adapter, value, which):
    key = poison_tensor(adapter, value, which)
    with pytest.raises(AdapterValidationError, match="NaN or infinite") as e:
        inspect_adapter(adapter, shapes(micro), max_rank=8)
    assert key in str(e.value)


@pytest.mark.parametrize("name", ["adapter_model.bin", "training_args.bin", "weights.pt", "x.PTH"])
def test_pickle_files_are_refused_with_a_conversion_hint(micro, adapter, name):
    (adapter / name).write_bytes(b"\x80\x04K\x01.")  # a pickle
    with pytest.raises(AdapterValidationError, match="pickle") as e:
        inspect_adapter(adapter, shapes(micro), max_rank=8)
    assert name in str(e.value) and "safetensors" in str(e.value)


def test_pickle_only_adapter_is_refused_as_pickle(micro, adapter):
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(AdapterValidationError, match="adapter_model.bin is a pickle file"):
        inspect_adapter(adapter, shapes(micro), max_rank=8)


def test_symlinked_weights_outside_the_roots_are_refused(micro, adapter, tmp_path):
    root = str(adapter.parent)
    outside = tmp_path / "outside"
    outside.mkdir()
    weights = adapter / "adapter_model.safetensors"
    shutil.move(weights, outside / "w.safetensors")
    os.symlink(outside / "w.safetensors", weights)
    with pytest.raises(AdapterValidationError, match="outside the adapter roots") as e:
        inspect_adapter(adapter, shapes(micro), max_rank=8, roots=(root,))
    assert "resolves to" not in str(e.value)  # the real path is for the server log only
    assert "adapter_model.safetensors resolves to" in e.value.described()
    # Without roots (a config adapter) the same directory is a valid adapter.
    assert inspect_adapter(adapter, shapes(micro), max_rank=8).rank == 4


def test_a_directory_link_out_of_the_roots_is_refused(adapter):
    root = str(adapter.parent)
    os.symlink("/etc", adapter / "extra")  # a directory link: listed, not followed, still refused
    with pytest.raises(AdapterValidationError, match="extra resolves outside the adapter roots") as e:
        check_files(adapter, (root,))
    assert "extra resolves to '/etc'" in e.value.described()


def test_symlinks_that_stay_inside_the_roots_are_fine(micro, adapter):
    root = adapter.parent
    shared = root / "shared"
    shared.mkdir()
    shutil.move(adapter / "adapter_model.safetensors", shared / "w.safetensors")
    os.symlink(shared / "w.safetensors", adapter / "adapter_model.safetensors")
    assert inspect_adapter(adapter, shapes(micro), max_rank=8, roots=(str(root),)).rank == 4


def test_directory_resolving_outside_the_roots_is_refused(micro, adapter, tmp_path):
    link_root = tmp_path / "links"
    link_root.mkdir()
    os.symlink(adapter, link_root / "a")
    with pytest.raises(AdapterValidationError, match="resolves outside the adapter roots"):
        check_files(link_root / "a", (str(link_root),))

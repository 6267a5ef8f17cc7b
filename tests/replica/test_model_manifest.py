"""A replica checks its node's model directory against the server's list of it before it starts:
missing, with files missing or of other sizes, or with another config.json, it refuses in one line
naming the node and the path; a matching directory, extra files or a hub id pass."""

from __future__ import annotations

import shutil

import pytest

from dlora.replica.errors import ReplicaFailure
from dlora.replica.model_manifest import ModelMismatch, check, manifest_of, mismatch


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 64}')
    (d / "model.safetensors").write_bytes(b"w" * 100)
    (d / "tokenizer.json").write_text("{}")
    (d / ".cache").mkdir()
    return d


def test_the_same_directory_elsewhere_matches_and_extra_files_do_not_matter(model, tmp_path):
    manifest = manifest_of(str(model))
    assert manifest is not None and [n for n, _ in manifest.files] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    copy = tmp_path / "node2"
    shutil.copytree(model, copy)
    (copy / "README.md").write_text("extra")
    assert mismatch(str(copy), manifest) is None
    check(str(copy), manifest, "10.0.0.2 (node ab)")  # no raise
    assert manifest_of("org/some-hub-model") is None and mismatch("org/some-hub-model", None) is None


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda d: shutil.rmtree(d), "it is missing"),
        (lambda d: (d / "model.safetensors").unlink(), "1 file(s) of the server's are missing: model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"w" * 99), "1 file(s) differ in size from the server's"),
        (lambda d: (d / "config.json").write_text('{"hidden_size": 32}'), "its config.json differs from the server's"),
    ],
)
def test_a_node_without_the_servers_model_refuses_to_start_in_one_line(model, damage, why):
    manifest = manifest_of(str(model))
    damage(model)
    with pytest.raises(ModelMismatch) as e:
        check(str(model), manifest, "10.0.0.2 (node ab)")
    line = str(e.value)
    assert line.startswith(f"node 10.0.0.2 (node ab): model directory {model}: {why}") and "\n" not in line
    assert isinstance(e.value, ReplicaFailure)  # the router treats it as a failed start: retries, then gives up

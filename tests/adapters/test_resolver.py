"""The filesystem resolver: which client-chosen names may be looked up, and where they are found."""

from __future__ import annotations

import pytest

from dlora.adapters.resolver import MAX_SEGMENTS, FilesystemResolver, is_resolvable_name


def adapter_dir(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return path


@pytest.mark.parametrize("name", ["a", "a3", "my-adapter_v1.2", "team/summariser", "/".join(["x"] * MAX_SEGMENTS)])
def test_plain_names_may_be_looked_up(name):
    assert is_resolvable_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "..",
        "../a",
        "a/..",
        "a/../b",
        "/abs",
        "a/",
        "a//b",
        ".hidden",
        "-flag",
        "a b",
        "a\\b",
        "é",
        "/".join(["x"] * (MAX_SEGMENTS + 1)),
        "x" * 129,
    ],
)
def test_names_that_could_walk_the_disk_are_never_looked_up(name):
    assert not is_resolvable_name(name)


def test_the_first_root_holding_the_name_wins(tmp_path):
    first, second = tmp_path / "r1", tmp_path / "r2"
    adapter_dir(second / "a")
    adapter_dir(second / "team" / "b")
    adapter_dir(first / "b")
    shadowed = adapter_dir(first / "team" / "b")
    resolver = FilesystemResolver((str(first), str(second)))
    assert resolver.resolve("a") == str(second / "a")
    assert resolver.resolve("team/b") == str(shadowed)
    assert resolver.resolve("missing") is None


def test_a_directory_without_adapter_config_is_not_an_adapter(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("not a directory")
    resolver = FilesystemResolver((str(tmp_path),))
    assert resolver.resolve("model") is None
    assert resolver.resolve("file") is None


def test_an_unsafe_name_is_refused_even_where_it_would_find_files(tmp_path):
    adapter_dir(tmp_path / "secret")
    root = tmp_path / "root"
    root.mkdir()
    assert FilesystemResolver((str(root),)).resolve("../secret") is None

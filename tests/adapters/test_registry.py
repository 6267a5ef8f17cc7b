import json

import pytest

from dlora.adapters.registry import AdapterExistsError, AdapterNotFoundError, AdapterRegistry
from dlora.adapters.validate import AdapterInfo

INFO = AdapterInfo(path="/x/a", rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), size_bytes=10)


def test_ids_are_stable_and_never_reused(tmp_path):
    reg = AdapterRegistry(tmp_path)
    a = reg.add("a", INFO)
    b = reg.add("b", INFO)
    reg.remove("a")
    c = reg.add("c", INFO)
    assert (a.int_id, b.int_id, c.int_id) == (1, 2, 3)


def test_duplicate_and_missing_names(tmp_path):
    reg = AdapterRegistry(tmp_path)
    reg.add("a", INFO)
    with pytest.raises(AdapterExistsError):
        reg.add("a", INFO)
    with pytest.raises(AdapterNotFoundError):
        reg.get("zzz")
    with pytest.raises(AdapterNotFoundError):
        reg.remove("zzz")


def test_only_api_adapters_persist_and_reload(tmp_path):
    reg = AdapterRegistry(tmp_path)
    reg.add("from_cfg", INFO, source="config")
    reg.add("from_api", INFO, pinned=True)
    saved = json.loads((tmp_path / "adapters.json").read_text())
    assert [a["name"] for a in saved["adapters"]] == ["from_api"]

    again = AdapterRegistry(tmp_path)
    recs = again.load_persisted()
    assert [(r.name, r.pinned, r.target_modules) for r in recs] == [("from_api", True, ("q_proj", "v_proj"))]
    assert again.add("new", INFO).int_id == 3  # continues after the persisted next_id


def test_no_state_dir_means_memory_only(tmp_path):
    reg = AdapterRegistry(None)
    reg.add("a", INFO)
    assert reg.load_persisted() == []
    assert list(tmp_path.iterdir()) == []


def _saved(reg_dir):
    return json.loads((reg_dir / "adapters.json").read_text())


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "not valid JSON"),
        ('["a", "list"]', "expected an object"),
        ('{"next_id": 3, "adapters": "nope"}', "expected an object"),
    ],
)
def test_corrupt_file_is_moved_aside_and_named_in_the_log(tmp_path, caplog, content, why):
    (tmp_path / "adapters.json").write_text(content)
    reg = AdapterRegistry(tmp_path)
    with caplog.at_level("WARNING"):
        assert reg.load_persisted() == []
    aside = list(tmp_path.glob("adapters.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content  # kept for the operator, untouched
    assert not (tmp_path / "adapters.json").exists()
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert str(tmp_path / "adapters.json") in warning and str(aside[0]) in warning and why in warning
    reg.add("fresh", INFO)  # the registry works and writes a new file
    assert [a["name"] for a in _saved(tmp_path)["adapters"]] == ["fresh"]


def test_bad_entries_are_dropped_the_good_ones_kept_and_the_file_moved_aside(tmp_path, caplog):
    reg = AdapterRegistry(tmp_path)
    good = reg.add("good", INFO)
    data = _saved(tmp_path)
    data["adapters"] += [
        {"name": "no_fields"},
        {**data["adapters"][0], "name": "bad_rank", "rank": "8"},
        {**data["adapters"][0]},
        7,
    ]  # missing fields, wrong type, duplicate, not an object
    (tmp_path / "adapters.json").write_text(json.dumps(data))
    again = AdapterRegistry(tmp_path)
    with caplog.at_level("WARNING"):
        assert again.load_persisted() == [good]
    assert len(list(tmp_path.glob("adapters.json.corrupt-*"))) == 1
    assert "adapters[1]" in caplog.text and "adapters[2]" in caplog.text and "adapters[3]" in caplog.text
    assert again.add("next", INFO).int_id == good.int_id + 1  # ids still never reused


def test_unwritable_state_dir_serves_from_memory_with_a_warning(tmp_path, caplog):
    """A state_dir that cannot be created (its parent is a regular file: root ignores chmod)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    reg = AdapterRegistry(blocker / "state")
    with caplog.at_level("WARNING"):
        assert reg.load_persisted() == []
        rec = reg.add("a", INFO)
    assert reg.get("a") == rec and reg.unpersisted_reason is not None
    assert str(blocker / "state") in caplog.text and "not persisted" in caplog.text
    assert "changed in memory only" in caplog.text
    reg.remove("a")
    assert "a" not in reg


def test_failed_save_rolls_back_so_memory_matches_disk(tmp_path, monkeypatch):
    from dlora.adapters import registry_store
    from dlora.adapters.registry_store import RegistryPersistError

    reg = AdapterRegistry(tmp_path)
    reg.load_persisted()
    reg.add("kept", INFO)
    before = (tmp_path / "adapters.json").read_text()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(registry_store.os, "replace", full_disk)
    with pytest.raises(RegistryPersistError, match="No space left on device"):
        reg.add("lost", INFO)
    assert "lost" not in reg
    with pytest.raises(RegistryPersistError):
        reg.remove("kept")
    assert "kept" in reg
    assert (tmp_path / "adapters.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.json"]  # no temp file left behind


def test_an_update_is_a_new_version_under_a_new_id_and_persists(tmp_path):
    import dataclasses

    reg = AdapterRegistry(tmp_path)
    reg.load_persisted()
    first = reg.add("a", INFO, pinned=True)
    newer = dataclasses.replace(INFO, path="/x/a-2", rank=4)
    new = reg.next_version("a", newer)
    assert reg.get("a") == first  # not served before it is committed (after every engine loaded it)
    assert reg.commit(new) == new and reg.get("a") == new
    assert (new.version, new.path, new.rank, new.pinned) == (2, "/x/a-2", 4, True)
    assert new.int_id != first.int_id  # engines must never take one version for the other
    third = reg.commit(reg.next_version("a", INFO))
    assert third.version == 3 and len({first.int_id, new.int_id, third.int_id}) == 3
    again = AdapterRegistry(tmp_path).load_persisted()
    assert [(r.name, r.version, r.int_id) for r in again] == [("a", 3, third.int_id)]
    with pytest.raises(AdapterNotFoundError):
        reg.next_version("missing", INFO)


def test_a_failed_update_save_keeps_the_old_version(tmp_path, monkeypatch):
    from dlora.adapters import registry_store
    from dlora.adapters.registry_store import RegistryPersistError

    reg = AdapterRegistry(tmp_path)
    reg.load_persisted()
    first = reg.add("a", INFO)
    monkeypatch.setattr(registry_store.os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(RegistryPersistError):
        reg.commit(reg.next_version("a", INFO))
    assert reg.get("a") == first

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

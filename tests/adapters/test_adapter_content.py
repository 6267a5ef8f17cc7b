"""An adapter version's content identity: the snapshot's digest is the one a replica on another node
computes from the bytes it receives; the registry record carries it and, in a Ray cluster, the
files' object-store reference, which never reaches the registry file; without Ray there is none."""

from __future__ import annotations

import json

from dlora.adapters import snapshot
from dlora.adapters.lifecycle import ref_of, with_content
from dlora.adapters.registry import AdapterRecord, AdapterRegistry
from dlora.adapters.validate import CONFIG_FILE, WEIGHTS_FILE, AdapterInfo
from dlora.replica.adapter_source import AdapterSource, content_digest, manifest_digest


def _snapshot(tmp_path, weights: bytes = b"\x00weights") -> snapshot.Snapshot:
    src = tmp_path / "src"
    src.mkdir()
    (src / CONFIG_FILE).write_text(json.dumps({"r": 8}))
    (src / WEIGHTS_FILE).write_bytes(weights)
    staged, digest = snapshot.stage(src, tmp_path / "snapshots")
    return snapshot.commit(staged, tmp_path / "snapshots", "a", digest)


def test_the_snapshot_digest_is_the_content_digest_of_its_files(tmp_path):
    snap = _snapshot(tmp_path)
    files = snapshot.read_files(snap.path)
    assert set(files) == {CONFIG_FILE, WEIGHTS_FILE}
    assert content_digest(files) == snap.sha256 == manifest_digest(str(snap.path)) == snapshot.verify(snap.path)
    changed = dict(files, **{WEIGHTS_FILE: b"\x00weightz"})
    assert content_digest(changed) != snap.sha256


def test_a_record_carries_its_digest_and_source_but_saves_neither(tmp_path):
    snap = _snapshot(tmp_path)
    info = AdapterInfo(path=str(snap.path), rank=8, alpha=16.0, target_modules=("q_proj",), size_bytes=8)
    registry = AdapterRegistry(tmp_path / "state")
    rec = registry.new_record("a", info, False, "api", 1)
    plain = with_content(rec, snap)  # no Ray in this process: no source, the path is read as given
    assert plain.digest == snap.sha256 and plain.content is None
    assert with_content(rec, None) is rec  # no snapshot (no state dir): nothing to send
    source = AdapterSource(snap.sha256, object())  # what Ray's object reference stands for here
    shipped = AdapterRecord(**{**plain.__dict__, "content": source})
    ref = ref_of(shipped)
    assert (ref.digest, ref.source, ref.path) == (snap.sha256, source, str(snap.path))
    saved = shipped.to_json()
    assert "content" not in saved and "digest" not in saved
    # the digest comes back from the snapshot's manifest when the registration is restored
    assert AdapterRecord.from_json(saved) == AdapterRecord(**{**plain.__dict__, "digest": ""})
    registry.commit(shipped)
    on_disk = json.loads((tmp_path / "state" / "adapters.json").read_text())["adapters"][0]
    assert set(on_disk) == set(saved)

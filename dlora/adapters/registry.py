"""The cluster-wide adapter registry: names, validated paths, stable integer ids, persistence.

Only registered names ever reach an engine. The registry is persisted as JSON in the state
directory so that adapters registered through the admin API survive a server restart.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dlora.adapters import registry_store as store
from dlora.adapters.registry_store import CorruptRegistryFile, RegistryPersistError
from dlora.adapters.validate import AdapterInfo
from dlora.replica.adapter_source import AdapterSource
from dlora.slo.config import AdapterSlo, parse_adapter_slo

log = logging.getLogger(__name__)

REGISTRY_FILE = "adapters.json"


class AdapterExistsError(KeyError):
    pass


class AdapterNotFoundError(KeyError):
    pass


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    int_id: int  # vLLM's lora_int_id; never reused within one registry file
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    pinned: bool = False
    # "config" adapters come from the YAML file and are re-read at start; "api" ones are persisted.
    source: str = "api"
    # 1 at registration, +1 for each in-place update (`load_inplace`); each version has its own int_id.
    version: int = 1
    # Its own latency targets; None: the server's default (`slo:`). Kept by an in-place update.
    slo: AdapterSlo | None = None
    # sha256 of its snapshot's files (its manifest keeps it too: not saved here); "" without a snapshot
    digest: str = ""
    # Its files in Ray's object store, for replicas on other nodes (adapter_source.py): held while
    # this record is, so Ray frees them once the version is unloaded or replaced. Never saved.
    content: AdapterSource | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        d = asdict(replace(self, content=None))  # slo: {"ttft_s", "tpot_s"} or None
        del d["content"], d["digest"]
        d["target_modules"] = list(self.target_modules)
        return d

    @classmethod
    def from_json(cls, d: dict) -> AdapterRecord:
        """A saved entry (files written before SLOs existed have no "slo": the default applies);
        a bad "slo" raises ValueError naming the key."""
        return cls(**{**d, "target_modules": tuple(d["target_modules"]), "slo": parse_adapter_slo(d.get("slo"))})


class AdapterRegistry:
    def __init__(self, state_dir: Path | None):
        self._file = state_dir / REGISTRY_FILE if state_dir else None
        self._records: dict[str, AdapterRecord] = {}
        self._next_id = 1
        # Why registrations stay in memory only although a state_dir was given (set at load time).
        self.unpersisted_reason: str | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, name: str) -> AdapterRecord:
        try:
            return self._records[name]
        except KeyError:
            raise AdapterNotFoundError(name) from None

    def all(self) -> list[AdapterRecord]:
        return sorted(self._records.values(), key=lambda r: r.int_id)

    def add(
        self,
        name: str,
        info: AdapterInfo,
        pinned: bool = False,
        source: str = "api",
        version: int = 1,
        slo: AdapterSlo | None = None,
    ) -> AdapterRecord:
        """Record and persist; a failed save undoes the record (RegistryPersistError), so memory and
        disk always agree."""
        if name in self._records:
            raise AdapterExistsError(name)
        return self.commit(self.new_record(name, info, pinned, source, version, slo))

    def next_version(self, name: str, info: AdapterInfo, slo: AdapterSlo | None = None) -> AdapterRecord:
        """A new version of a registered adapter under a new int_id (so nothing computed with the old
        weights, in any engine, can be taken for the new), not yet recorded: `commit` it once every
        engine has loaded it. It keeps the old version's SLO unless given one."""
        old = self.get(name)
        return self.new_record(name, info, old.pinned, old.source, old.version + 1, slo or old.slo)

    def new_record(
        self, name: str, info: AdapterInfo, pinned: bool, source: str, version: int, slo: AdapterSlo | None = None
    ) -> AdapterRecord:
        """A record with a fresh int_id, not yet in the registry."""
        rec = AdapterRecord(
            name=name,
            int_id=self._next_id,
            path=info.path,
            rank=info.rank,
            alpha=info.alpha,
            target_modules=info.target_modules,
            size_bytes=info.size_bytes,
            pinned=pinned,
            source=source,
            version=version,
            slo=slo,
        )
        self._next_id += 1  # not undone on failure: ids are never reused, a gap is harmless
        return rec

    def commit(self, rec: AdapterRecord) -> AdapterRecord:
        """Record `rec` (in place of any record of its name) and persist it when the persisted set
        changes; a failed save puts the previous state back (RegistryPersistError)."""
        previous = self._records.get(rec.name)
        self._records[rec.name] = rec
        if rec.source != "api" and (previous is None or previous.source != "api"):
            return rec  # not in the file: nothing to write
        try:
            self.save()
        except RegistryPersistError:
            if previous is None:
                del self._records[rec.name]
            else:
                self._records[rec.name] = previous
            raise
        return rec

    def remove(self, name: str) -> AdapterRecord:
        """Forget and persist; a failed save puts the record back (RegistryPersistError)."""
        rec = self.get(name)
        del self._records[name]
        try:
            self.save()
        except RegistryPersistError:
            self._records[name] = rec
            raise
        return rec

    def load_persisted(self) -> list[AdapterRecord]:
        """Records saved by an earlier run (not yet re-validated or added). Never raises: a corrupt
        file is moved aside and its valid entries kept; a state dir that cannot be written turns
        persistence off with a warning (registrations then last until the server stops)."""
        if not self._file:
            return []
        records = self._read_records(self._file)
        problem = store.writable_problem(self._file.parent)
        if problem is not None:
            self.unpersisted_reason = f"server.state_dir {self._file.parent} is not writable ({problem})"
            log.warning(
                "%s: adapters registered through the admin API will be served but not persisted",
                self.unpersisted_reason,
            )
        return records

    def _read_records(self, file: Path) -> list[AdapterRecord]:
        try:
            data = store.read(file)
        except CorruptRegistryFile as e:
            store.set_aside(file, str(e))
            return []
        if data is None:
            return []
        records, bad = parse_records(data.get("adapters", []))
        next_id = data.get("next_id", 1)
        if not isinstance(next_id, int) or isinstance(next_id, bool):
            bad.append(f"next_id {next_id!r} is not an integer")
            next_id = 1
        if bad:
            store.set_aside(file, "; ".join(bad))
        self._next_id = max(self._next_id, next_id, *(r.int_id + 1 for r in records))
        return records

    def save(self) -> None:
        if not self._file:
            return
        if self.unpersisted_reason is not None:
            log.warning("adapter registry changed in memory only: %s", self.unpersisted_reason)
            return
        data = {
            "next_id": self._next_id,
            "adapters": [r.to_json() for r in self.all() if r.source == "api"],
        }
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise store.persist_error(self._file, e) from e
        store.write(self._file, data)


_FIELD_KINDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "int_id": int,
    "path": str,
    "rank": int,
    "alpha": (int, float),
    "size_bytes": int,
    "pinned": bool,
    "source": str,
    "version": int,
}


def parse_records(entries: list) -> tuple[list[AdapterRecord], list[str]]:
    """The valid entries as records, and what was wrong with each bad one (skipped)."""
    records: list[AdapterRecord] = []
    bad: list[str] = []
    names: set[str] = set()
    ids: set[int] = set()
    for i, d in enumerate(entries):
        try:
            if not isinstance(d, dict) or not isinstance(d.get("target_modules"), list):
                raise ValueError("not an object with a target_modules list")
            rec = AdapterRecord.from_json(d)
            check_record(rec)
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            bad.append(f"adapters[{i}]: {e}")
            continue
        if rec.name in names or rec.int_id in ids:
            bad.append(f"adapters[{i}]: duplicate name {rec.name!r} or id {rec.int_id}")
            continue
        names.add(rec.name)
        ids.add(rec.int_id)
        records.append(rec)
    return records, bad


def check_record(rec: AdapterRecord) -> None:
    for key, kind in _FIELD_KINDS.items():
        value = getattr(rec, key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{key}={value!r} has the wrong type")
    if not rec.name or rec.int_id < 1 or rec.version < 1 or not all(isinstance(m, str) for m in rec.target_modules):
        raise ValueError(f"invalid entry {rec.name!r}")

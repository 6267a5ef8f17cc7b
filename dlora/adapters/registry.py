"""The cluster-wide adapter registry: names, validated paths, stable integer ids, persistence.

Only registered names ever reach an engine. The registry is persisted as JSON in the state
directory so that adapters registered through the admin API survive a server restart.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dlora.adapters.validate import AdapterInfo

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

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "AdapterRecord":
        return cls(**{**d, "target_modules": tuple(d["target_modules"])})


class AdapterRegistry:
    def __init__(self, state_dir: Path | None):
        self._file = state_dir / REGISTRY_FILE if state_dir else None
        self._records: dict[str, AdapterRecord] = {}
        self._next_id = 1

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

    def add(self, name: str, info: AdapterInfo, pinned: bool = False, source: str = "api") -> AdapterRecord:
        if name in self._records:
            raise AdapterExistsError(name)
        rec = AdapterRecord(
            name=name, int_id=self._next_id, path=info.path, rank=info.rank, alpha=info.alpha,
            target_modules=info.target_modules, size_bytes=info.size_bytes, pinned=pinned, source=source,
        )
        self._next_id += 1
        self._records[name] = rec
        self.save()
        return rec

    def remove(self, name: str) -> AdapterRecord:
        rec = self.get(name)
        del self._records[name]
        self.save()
        return rec

    def load_persisted(self) -> list[AdapterRecord]:
        """Records saved by an earlier run (not yet re-validated or added)."""
        if not self._file or not self._file.is_file():
            return []
        data = json.loads(self._file.read_text())
        self._next_id = max(self._next_id, int(data.get("next_id", 1)))
        return [AdapterRecord.from_json(d) for d in data.get("adapters", [])]

    def save(self) -> None:
        if not self._file:
            return
        self._file.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "next_id": self._next_id,
            "adapters": [r.to_json() for r in self.all() if r.source == "api"],
        }
        # Write-then-rename so a crash mid-write never leaves a truncated registry.
        fd, tmp = tempfile.mkstemp(dir=self._file.parent, prefix=".adapters.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, self._file)

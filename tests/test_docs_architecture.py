"""docs/architecture.md's module map and request path name the code as it is: every path it names
exists, and every module of the package is named in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_path_the_document_names_exists():
    named = re.findall(r"`(dlora/[\w/.]+)`", DOC)
    assert named, "the module map names dlora's paths"
    assert [p for p in named if not (ROOT / p.rstrip("/")).exists()] == []


def package_of(named: str) -> str:
    """The package a module-map row speaks of: the path it starts with, or that file's directory."""
    return named.rstrip("/").rsplit("/", 1)[0] if named.endswith(".py") else named.rstrip("/")


def test_every_module_is_in_the_module_map():
    """A module is named by its path, or by its file name in its package's row (the row that
    starts with the package's path)."""
    rows = [(package_of(m.group(1)), m.group(0)) for m in re.finditer(r"^\| `(dlora/[\w/.]+)`.*$", DOC, re.M)]
    missing = []
    for path in sorted((ROOT / "dlora").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") or f"`{rel}`" in DOC:
            continue
        package_rows = [row for package, row in rows if rel.startswith(package + "/")]
        if not any(f"`{path.name}`" in row or f"`{path.parent.name}/`" in row for row in package_rows):
            missing.append(rel)
    assert missing == []

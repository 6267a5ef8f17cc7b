"""pyproject lists packages by hand (kernels/ installs as dlora_kernels); none may be missing."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(meta["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dlora").rglob("__init__.py")}
    found |= {
        "dlora_kernels" + "".join("." + x for x in p.parent.relative_to(ROOT / "kernels").parts)
        for p in (ROOT / "kernels").rglob("__init__.py")
    }
    assert found == listed


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make serve" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()

"""pyproject.toml says what the package ships and needs, and nothing else."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "src" / "hybridpar"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_package_data_globs_match_every_data_file_and_nothing_is_dead():
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["hybridpar"]
    matched = {g: {p for p in PKG.glob(g) if p.is_file()} for g in globs}
    assert all(matched.values()), [g for g, m in matched.items() if not m]
    data = {p for p in PKG.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
            and "__pycache__" not in p.parts}
    assert data <= set().union(*matched.values()), sorted(str(p) for p in data - set().union(*matched.values()))


def test_every_runtime_dependency_is_imported():
    import re

    names = [re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in _pyproject()["project"]["dependencies"]]
    modules = {"scikit-learn": "sklearn", "pyyaml": "yaml", "ortools": "ortools"}
    source = "\n".join(p.read_text() for p in PKG.rglob("*.py"))
    unused = [n for n in names
              if not re.search(rf"^\s*(import|from) {re.escape(modules.get(n, n))}\b", source, re.M)]
    assert not unused, unused

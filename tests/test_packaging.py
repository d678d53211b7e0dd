"""`pip install .` ships every subpackage: each folder with an __init__.py is listed in pyproject."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_declared():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    assert config["package-dir"] == {"mambastep": "."}
    found = {"mambastep"}
    for top in ("runtime", "kernels", "graphs", "tools"):
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(("mambastep",) + init.parent.relative_to(ROOT).parts))
    assert found == declared

"""`pip install .` ships every subpackage: each folder with an __init__.py is listed in pyproject;
imports run one way; and the tests run from a checkout under any directory name."""

import importlib.metadata
import shutil
import subprocess
import sys
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


# The floors, top down: a module may import its own floor or one below, never one above;
# graphs and kernels stand beside each other and import nothing of each other.
FLOORS = {"tools": 3, "runtime": 2, "graphs": 1, "kernels": 1}


def _imported_floors(path: Path):
    """(line, floor) of every mambastep module a source file imports, relative or absolute."""
    import ast

    parts = path.relative_to(ROOT).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb from the module's package
                package = parts[:-1][: len(parts) - node.level]
                target = package + tuple((node.module or "").split(".")) if node.module else package
            elif node.module and node.module.startswith("mambastep."):
                target = tuple(node.module.split(".")[1:])
            else:
                continue
            if target and target[0] in FLOORS:
                yield node.lineno, target[0]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name.split(".")
                if name[0] == "mambastep" and len(name) > 1 and name[1] in FLOORS:
                    yield node.lineno, name[1]


def test_imports_run_one_way():
    """tools -> runtime -> graphs, kernels: no module imports a folder above it, and graphs and
    kernels import nothing of each other."""
    wrong = []
    for top, floor in FLOORS.items():
        for path in (ROOT / top).rglob("*.py"):
            for line, target in _imported_floors(path):
                if target != top and FLOORS[target] >= floor:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, wrong


def test_the_tests_run_from_a_checkout_under_any_directory_name(tmp_path):
    """A download unpacked as ``mambastep-main`` (no Python name): pytest still imports the
    checkout's root ``__init__.py`` as its test package's, and the tests run."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    copy = tmp_path / "mambastep-main"
    for name in filter(None, listed.stdout.split("\0")):
        if not (ROOT / name).is_file():  # a copy of the tree whose index is older than its files
            continue
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/kernels/test_activation.py"], cwd=copy, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_bare_name_kernels_never_resolves_to_the_checkout():
    """transformers 5.25 imports HF's ``kernels`` package. With the checkout's root on sys.path
    (``python3 -m pytest`` or ``python3 -c`` run from it, a script kept in it) the bare name
    reaches that package, in this process and in one started from the root, and HF's models
    import; with no such package it fails as if there were none."""
    import kernels

    where = Path(kernels.__file__).resolve()
    code = "import kernels; print(kernels.__file__); import transformers.models.nemotron_h.modeling_nemotron_h"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if _hf_kernels_installed():
        assert not where.is_relative_to(ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not Path(done.stdout.splitlines()[0]).resolve().is_relative_to(ROOT)
    # without site-packages or PYTHONPATH (-S -E): only the checkout has the name, and it refuses it
    alone = subprocess.run([sys.executable, "-S", "-E", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kernels"],
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode != 0
    assert "ModuleNotFoundError: No module named 'kernels'" in alone.stderr
    assert "is mambastep.kernels" in alone.stderr


def test_the_engine_room_never_imports_the_serving_room():
    """runtime/serving (text and the server) sits on the Engine; no module of the model runtime
    imports it, so the engine and the model read without the server."""
    import ast

    wrong = []
    for path in (ROOT / "runtime").rglob("*.py"):
        if "serving" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "serving" in node.module.split("."):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, wrong

"""The installed layout: only ``genworker`` at the top, core stays pure."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import genworker.core

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("genworker.shell", "vllm", "ray", "zmq", "torch.distributed")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("genworker-*.whl")
    return found


def test_only_genworker_at_the_wheel_top_level(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert tops == {"genworker", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "genworker/core/py.typed" in names
    assert "genworker/__init__.py" in names
    assert "genworker/shell/py.typed" in names


def test_bare_core_shell_and_demo_are_not_importable_from_an_install(
    wheel: Path, tmp_path: Path
) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    probe = (
        "import importlib.util, sys\n"
        "import genworker.core, genworker.shell.errors\n"
        f"assert genworker.core.__file__.startswith({str(target)!r}), genworker.core.__file__\n"
        "print(*(importlib.util.find_spec(n) for n in ('core', 'shell', 'demo', 'package')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r})\n{probe}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None None None None"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_core_sources_import_nothing_effectful() -> None:
    core_dir = Path(genworker.core.__file__).resolve().parent
    offenders = {
        f"{path.name}: {name}"
        for path in core_dir.glob("*.py")
        for name in _imports(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    }
    assert not offenders


def test_importing_core_loads_no_engine_runtime() -> None:
    probe = (
        "import sys, pkgutil, importlib, genworker.core as c\n"
        "for m in pkgutil.iter_modules(c.__path__):\n"
        "    importlib.import_module('genworker.core.' + m.name)\n"
        "print(sorted(n for n in ('vllm', 'ray', 'zmq', 'genworker.shell') if n in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _dist(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def _third_party(folder: str) -> dict[str, set[str]]:
    """Each third-party top-level name the folder's modules import: the distributions
    that provide it here (its own name where none is installed)."""
    provided = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in (REPO / folder).rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("genworker", "__future__"):
                continue
            found.setdefault(top, set()).update(_dist(d) for d in provided.get(top, [top]))
    return found


def test_every_third_party_import_is_declared_core_s_in_the_base_dependencies() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_dist(r) for r in project["dependencies"]}
    extras = {_dist(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    for folder in ("core", "shell", "demo"):
        declared = base if folder == "core" else base | extras
        missing = {top for top, dists in _third_party(folder).items() if not dists & declared}
        assert not missing, f"{folder}/ imports undeclared {sorted(missing)}"


def test_the_version_has_one_source_pyproject() -> None:
    import genworker

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert genworker.__version__ == declared
    assert genworker.__version__ == importlib.metadata.version("genworker")

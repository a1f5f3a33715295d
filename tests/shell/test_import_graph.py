"""The house's shape, checked on the source: no import loop between genworker's modules,
no module reaching for another module's private names, no function in the shell over 80
lines (issue 41). The layers themselves are import-linter contracts in ``make typecheck``
(pyproject.toml ``[tool.importlinter]``); these are the rules a layer contract cannot say.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The source folders and the package each installs as (pyproject's package-dir).
PACKAGES: Mapping[str, str] = {
    "core": "genworker.core",
    "shell": "genworker.shell",
    "demo": "genworker.demo",
}
LONGEST_SHELL_FUNCTION = 80


def _modules() -> Iterator[tuple[str, Path]]:
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if m.startswith("genworker."))
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in edges), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    graph = grimp.ImportGraph()
    for a, b in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")]:
        graph.add_import(importer=f"genworker.{a}", imported=f"genworker.{b}")
    assert _cycles(graph) == [["genworker.a", "genworker.b", "genworker.c"]]


def test_no_module_of_genworker_takes_part_in_an_import_loop() -> None:
    """Lazy (function-level) imports count: a loop is a loop at run time too; imports
    under ``if TYPE_CHECKING:`` do not run and are left out."""
    graph = grimp.build_graph("genworker", exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def _imported_modules(tree: ast.Module, here: str) -> dict[str, str]:
    """Local names bound to another genworker module (``import genworker.x as m``,
    ``from genworker import x``, ``from genworker.shell import refit``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("genworker.") and alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("genworker"):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target != here and any(target == m for m, _ in _modules()):
                    bound[alias.asname or alias.name] = target
    return bound


def _private_reaches(module: str, path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(root)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("genworker"):
            if node.module == module:
                continue
            found.extend(
                f"{where}:{node.lineno} imports {node.module}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            )
    modules = _imported_modules(tree, module)
    found.extend(
        f"{where}:{node.lineno} reaches {modules[node.value.id]}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    )
    return found


def test_the_private_name_check_sees_both_ways_in(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from genworker.shell.worker import _helper\n"
        "from genworker.shell import extension as ext\n"
        "ext._loader(1)\n"
        "from genworker.shell.worker import VllmGenerationWorker, __all__\n"
    )
    assert _private_reaches("genworker.tests.m", source, tmp_path) == [
        "m.py:1 imports genworker.shell.worker._helper",
        "m.py:3 reaches genworker.shell.extension._loader",
    ]


def test_no_module_imports_a_private_name_of_another() -> None:
    """A private name used from another module has no home yet: give it one, public."""
    found = [reach for module, path in _modules() for reach in _private_reaches(module, path)]
    assert found == []


def _long_functions(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - start + 1
            if length > LONGEST_SHELL_FUNCTION:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)"


@pytest.mark.parametrize("folder", ["shell"])
def test_no_function_in_the_shell_runs_over_80_lines(folder: str) -> None:
    found = [f for path in sorted((ROOT / folder).rglob("*.py")) for f in _long_functions(path)]
    assert found == []

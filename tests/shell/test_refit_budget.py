"""The refit protocol's size budget (issue 11): ``shell/refit/`` plus ``shell/extension.py``
hold at most 1,600 code lines. Code lines are the lines a token of code touches:
docstrings, comments and blank lines do not count, and a statement over several lines
counts each of them."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGET = 1600
_LAYOUT = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_lines(source: str) -> int:
    """How many lines of ``source`` hold code (see the module docstring)."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _LAYOUT:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_the_counter_skips_docstrings_comments_and_blank_lines() -> None:
    source = '''"""A module.

It says things."""

# a comment
import os  # a trailing comment


def f(
    x: int,
) -> int:
    """Doc."""

    return os.getpid() + x
'''
    assert code_lines(source) == 5  # import, the signature's three lines, return


def test_shell_refit_and_the_extension_stay_within_the_budget() -> None:
    files = [*sorted((REPO / "shell" / "refit").glob("*.py")), REPO / "shell" / "extension.py"]
    counts = {f.relative_to(REPO).as_posix(): code_lines(f.read_text()) for f in files}
    assert sum(counts.values()) <= BUDGET, counts

"""Whether a script's running statement would start an engine again in vLLM's spawned
engine core: the decisions behind ``shell.startup.check_main_guard``.

Theory of operation
-------------------
vLLM's multiprocessing engine core (``AsyncLLM`` always; the CPU platform forces the
``spawn`` start method, ``vllm/platforms/cpu.py``, 0.32, and genworker does on CUDA)
starts a process that runs the parent's ``__main__`` script again, as ``__mp_main__``
(``multiprocessing/spawn.py``: ``_fixup_main_from_path``, or ``_fixup_main_from_name`` for
``python -m pkg.mod``; never for ``python -c``, an interactive session, or a package's
``__main__``): :func:`reruns_on_spawn`. A statement that starts the worker at the
script's top level, outside ``if __name__ == "__main__":``, starts it again in that child,
where multiprocessing refuses with "An attempt has been made to start a new process
before the current process has finished its bootstrapping phase": :func:`guarded_line`
tells, from the script's source, whether the running statement lies inside such a guard.
"""

from __future__ import annotations

import ast
import os
from typing import Final

__all__ = ["guarded_line", "reruns_on_spawn"]

_SKIPPED_MAIN_NAMES: Final = ("ipython",)


def reruns_on_spawn(spec_name: str | None, main_file: str | None) -> bool:
    """Whether a spawned child runs the ``__main__`` module's code again (as
    multiprocessing's ``spawn.get_preparation_data`` and ``_fixup_main_from_*`` decide)."""
    if spec_name is not None:
        return spec_name != "__main__" and not spec_name.endswith(".__main__")
    if main_file is None:
        return False
    stem = os.path.splitext(os.path.basename(main_file))[0]
    return stem not in _SKIPPED_MAIN_NAMES


def _is_main_test(test: ast.expr) -> bool:
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and len(test.comparators) == 1
    ):
        return False
    sides = (test.left, test.comparators[0])
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(mains) == 1


def guarded_line(source: str, line: int) -> bool | None:
    """Whether line ``line`` of the module ``source`` lies inside a top-level
    ``if __name__ == "__main__":`` body; ``None`` when it cannot be told (the source does
    not parse, or no top-level statement holds the line)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for statement in tree.body:
        end = statement.end_lineno or statement.lineno
        if statement.lineno <= line <= end:
            return isinstance(statement, ast.If) and _is_main_test(statement.test)
    return None

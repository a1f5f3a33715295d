"""Checks before an engine starts, on what only the running process can see.

Theory of operation
-------------------
- :func:`checked_model_source`: ``model_name`` against the filesystem, decided by
  ``core.model_source.classify_model`` (a mistyped local path is refused at once instead
  of costing vLLM's Hub retries).
- :func:`check_main_guard`: vLLM's multiprocessing engine core (``AsyncLLM`` always; the
  CPU platform forces the ``spawn`` start method, ``vllm/platforms/cpu.py``, 0.32, and
  genworker does on CUDA) starts a process that runs the parent's ``__main__`` script
  again, as ``__mp_main__`` (``multiprocessing/spawn.py``: ``_fixup_main_from_path``, or
  ``_fixup_main_from_name`` for ``python -m pkg.mod``; never for ``python -c``, an
  interactive session, or a package's ``__main__``). A script that starts the worker at
  its top level, outside ``if __name__ == "__main__":``, starts it again in that child,
  where multiprocessing refuses with "An attempt has been made to start a new process
  before the current process has finished its bootstrapping phase": the parent sees only
  "Engine core initialization failed". The check finds the script's statement that is
  running now (its module-level frame on the stack) and refuses, before anything is
  spawned, when that statement is not inside such a guard.
"""

from __future__ import annotations

import ast
import os
import sys
import types
from typing import Final

from genworker.core.model_source import ModelSource, classify_model
from genworker.shell.errors import BadConfigError, GenworkerError, unwrap

__all__ = [
    "UnguardedMainError",
    "check_main_guard",
    "checked_model_source",
    "guarded_line",
    "reruns_on_spawn",
]


class UnguardedMainError(GenworkerError, RuntimeError):
    """The engine would be started again by the process vLLM spawns for its engine core:
    the script starts it outside ``if __name__ == "__main__":``."""


def checked_model_source(name: str) -> ModelSource:
    """Where ``name`` (``model_name``) is read from; a :class:`BadConfigError` naming
    ``model_name`` when it is written as a local path but is no directory, names a file,
    or is neither a directory nor a Hub id."""
    path = os.path.expanduser(name)
    return unwrap(
        classify_model(name, is_dir=os.path.isdir(path), exists=os.path.exists(path)),
        BadConfigError,
        "worker config",
    )


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


def _main_statement_line(main: types.ModuleType) -> int | None:
    """The line of ``main``'s module-level code running now, if it is on the stack."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame.f_lineno
        frame = frame.f_back
    return None


def check_main_guard(what: str) -> None:
    """Refuse to start ``what`` from a script's top level without a ``__main__`` guard,
    when vLLM's spawned engine core would run that script again (module docstring)."""
    main = sys.modules.get("__main__")
    if main is None:
        return
    spec = getattr(main, "__spec__", None)
    main_file = getattr(main, "__file__", None)
    if not reruns_on_spawn(getattr(spec, "name", None), main_file):
        return
    line = _main_statement_line(main)
    if line is None or main_file is None:
        return
    try:
        with open(main_file, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return
    if guarded_line(source, line) is False:
        raise UnguardedMainError(
            f"{what} spawns vLLM's engine core process, which runs {main_file} again: "
            f"line {line} starts it at the script's top level. Guard your script's entry "
            "with if __name__ == '__main__': (see Python's multiprocessing docs, 'Safe "
            "importing of main module')"
        )

"""Checks before an engine starts, on what only the running process can see.

Theory of operation
-------------------
- :func:`checked_model_source`: ``model_name`` against the filesystem, decided by
  ``core.model_source.classify_model`` (a mistyped local path is refused at once instead
  of costing vLLM's Hub retries).
- :func:`check_main_guard`: a script that starts the worker at its top level, outside
  ``if __name__ == "__main__":``, would start it again in the process vLLM spawns for its
  engine core, where multiprocessing refuses and the parent sees only "Engine core
  initialization failed" (``core.main_guard`` decides, from the script's source, as its
  docstring says). The check finds the script's statement that is running now (its
  module-level frame on the stack) and refuses, before anything is spawned, when that
  statement is not inside such a guard.
"""

from __future__ import annotations

import os
import sys
import types

from genworker.core.main_guard import guarded_line, reruns_on_spawn
from genworker.core.model_source import ModelSource, classify_model
from genworker.shell.errors import BadConfigError, GenworkerError, unwrap

__all__ = [
    "UnguardedMainError",
    "check_main_guard",
    "checked_model",
    "checked_model_source",
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


def checked_model(model: object) -> str:
    """The engine kwargs' ``model``, checked where it is read from
    (:func:`checked_model_source`: a mistyped local path is refused, not sent to the Hub);
    a :class:`BadConfigError` when it is no str. Both vLLM adapters' ``start`` ask this."""
    if not isinstance(model, str):
        raise BadConfigError(f"engine kwargs need 'model' as a str, got {model!r}")
    checked_model_source(model)
    return model


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

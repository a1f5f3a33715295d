"""The PyTorch stack beside vLLM: a torchvision that cannot load next to the installed torch
is refused when an engine module is imported, with what to run (``core.torch_stack`` says
why it happens and what fixes it; docs/install.md)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

from genworker.core.torch_stack import torchvision_problem
from genworker.shell.errors import GenworkerError

__all__ = ["InstallError", "check_torchvision"]


class InstallError(GenworkerError, ImportError):
    """The installed packages cannot work together; the message says what to run."""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def check_torchvision() -> None:
    """Import torchvision if it is installed; an :class:`InstallError` if it cannot load."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
    except (RuntimeError, ImportError, OSError) as e:
        error = f"{type(e).__name__}: {e}"
        raise InstallError(
            torchvision_problem(_version("torch"), _version("torchvision"), error)
        ) from e

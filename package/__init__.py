"""genworker: a vLLM generation worker for RL training loops.

The library is :mod:`genworker.core` (pure plans and checks) and :mod:`genworker.shell`
(the workers, the engine adapters, the CLI). This package holds only the version, read
from the installed distribution's metadata, whose one source is ``pyproject.toml``.
"""

from importlib.metadata import version

__all__ = ["__version__"]

__version__: str = version("genworker")

"""genworker's imperative shell: the engine adapter, the worker, refit, the Ray group.

``import genworker.shell`` stays light: vLLM is imported when an engine starts, Ray when a
``GenerationGroup`` is first touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genworker.shell.errors import (
    BadArgumentError,
    BadBatchError,
    BadConfigError,
    EngineContractError,
    EngineDeadError,
    EngineStateError,
    GenerationAbortedError,
    GenworkerError,
    GroupError,
    RefitError,
    RefitManifestError,
    RefitTimeoutError,
    RefitWireError,
    UnsafePickleError,
    UnsupportedError,
)
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

if TYPE_CHECKING:
    from genworker.shell.group import ClusterSpec, GenerationGroup, local_cluster

__all__ = [
    "BadArgumentError",
    "BadBatchError",
    "BadConfigError",
    "ClusterSpec",
    "EngineContractError",
    "EngineDeadError",
    "EngineStateError",
    "ExistingEngine",
    "FakeEngine",
    "FakeEngineFactory",
    "GenerationAbortedError",
    "GenerationGroup",
    "GenworkerError",
    "GroupError",
    "RefitError",
    "RefitManifestError",
    "RefitTimeoutError",
    "RefitWireError",
    "UnsafePickleError",
    "UnsupportedError",
    "VllmGenerationWorker",
    "local_cluster",
]


def __getattr__(name: str) -> object:
    if name in ("ClusterSpec", "GenerationGroup", "local_cluster"):
        from genworker.shell import group

        return getattr(group, name)
    raise AttributeError(f"module 'genworker.shell' has no attribute {name!r}")

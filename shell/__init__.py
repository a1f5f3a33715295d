"""genworker's imperative shell: the engine adapter, the worker, refit, the Ray group.

``import genworker.shell`` stays light: vLLM is imported when an engine starts, Ray when a
``GenerationGroup`` is first touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genworker.shell.async_worker import AsyncVllmGenerationWorker, ExistingAsyncEngine
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
    RequestAbortedError,
    UnsafePickleError,
    UnsupportedError,
)
from genworker.shell.fake_async_engine import FakeAsyncEngine, FakeAsyncEngineFactory
from genworker.shell.fake_engine import FakeEngine, FakeEngineFactory
from genworker.shell.server import VERSIONS_HEADER, OpenAIServer
from genworker.shell.worker import ExistingEngine, VllmGenerationWorker

if TYPE_CHECKING:
    from genworker.shell.group import ClusterSpec, GenerationGroup, local_cluster

__all__ = [
    "VERSIONS_HEADER",
    "AsyncVllmGenerationWorker",
    "BadArgumentError",
    "BadBatchError",
    "BadConfigError",
    "ClusterSpec",
    "EngineContractError",
    "EngineDeadError",
    "EngineStateError",
    "ExistingAsyncEngine",
    "ExistingEngine",
    "FakeAsyncEngine",
    "FakeAsyncEngineFactory",
    "FakeEngine",
    "FakeEngineFactory",
    "GenerationAbortedError",
    "GenerationGroup",
    "GenworkerError",
    "GroupError",
    "OpenAIServer",
    "RefitError",
    "RefitManifestError",
    "RefitTimeoutError",
    "RefitWireError",
    "RequestAbortedError",
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

"""The CPU suite's engine fixtures, bound in this directory to the GPU session's engine.

``test_gpu_engine.py`` and ``test_gpu_worker.py`` run tests of ``tests/shell`` that take
``cpu_engine`` and ``cpu_llm`` (the CPU suite's names); here they are the session worker's
CUDA engine adapter and the ``vllm.LLM`` it wraps. They are module-scoped because
Hypothesis refuses function-scoped fixtures in ``@given`` tests. ``gpu_session`` comes from
the ``gpu.gpu_fixtures`` plugin, which every GPU test module loads.

The ``AsyncLLM`` modules (``test_gpu_async.py``, ``test_gpu_server.py``) run last: vLLM's
Prometheus logger of a new engine unregisters every ``vllm:`` metric of the process, so
after one has started the session engine's counters stay frozen (the H200 run of 7deb406:
two counter tests read the same totals before and after a batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from gpu.gpu_fixtures import GpuSession, session_engine

if TYPE_CHECKING:
    from vllm import LLM

    from genworker.shell.vllm_engine import VllmEngine


LAST = ("test_gpu_async.py", "test_gpu_server.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The AsyncLLM modules after the others, in their own order (a stable sort)."""
    items.sort(key=lambda item: item.path.name in LAST)


@pytest.fixture(scope="module")
def cpu_engine(gpu_session: GpuSession) -> VllmEngine:
    """The CPU suite's engine fixture: the session worker's CUDA engine."""
    return session_engine(gpu_session)


@pytest.fixture(scope="module")
def cpu_llm(cpu_engine: VllmEngine) -> LLM:
    """The CPU suite's raw ``vllm.LLM`` fixture: the one the CUDA adapter wraps."""
    return cpu_engine.llm

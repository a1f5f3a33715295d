"""Session fixtures for the real vLLM engine on CPU (a pytest plugin module).

One tiny model and ONE engine per pytest session: vLLM takes seconds to start, and the
adapter ``cpu_engine`` and the raw ``cpu_llm`` are the same engine. Settings that matter on CPU:

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process. vLLM keeps
  its parallel state in process globals, so stopping another in-process engine (the
  module-scoped ones of ``test_refit_engine.py``) while this one lives breaks it: those
  modules run before the first test that starts this one (file order), and the
  tensor-parallel engine of ``test_refit_tp.py`` runs its core in its own process.
- float32: bf16 prefill of <= 4 tokens dies with SIGILL on this host's CPU backend.
- An explicit ``kv_cache_memory_bytes`` where vLLM has it (vllm/v1/worker/cpu_worker.py
  ``determine_available_memory``, 0.32): with only ``gpu_memory_utilization`` the CPU
  worker subtracts the process RSS from a fraction of the NUMA node's memory, which goes
  negative on small hosts; the explicit size also skips the warm-up pass.
- ``disable_log_stats=False`` so ``LLM.get_metrics()`` has counters to read.

Set ``GENWORKER_MODEL_CACHE`` to a directory to keep the tiny model between sessions.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from genworker.demo.tiny_model import build_tiny_model, build_tiny_vlm

if TYPE_CHECKING:
    from vllm import LLM

    from genworker.shell.vllm_engine import VllmEngine

__all__ = [
    "EXTENSION_CLS",
    "SESSION_ENGINE_STARTED_BY",
    "cpu_engine",
    "cpu_engine_kwargs",
    "cpu_llm",
    "loop",
    "tiny_model_dir",
    "tiny_vlm_dir",
]

EXTENSION_CLS = "genworker.shell.extension.WorkerExtension"
_KV_CACHE_BYTES = 32 << 20
_MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The module's event loop, for the modules that drive an ``AsyncLLM``: the engine's
    output handler lives on the loop of its first request, so every coroutine of the
    module runs on this one (``async_helpers.run_soon``)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _extension_available() -> bool:
    module, _, name = EXTENSION_CLS.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def cpu_engine_kwargs(model: Path) -> dict[str, object]:
    """The ``vllm.LLM`` keyword arguments for the tiny model on CPU."""
    from genworker.shell.vllm_engine import engine_arg_names

    known = engine_arg_names()
    kwargs: dict[str, object] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": _MAX_MODEL_LEN,
        "seed": 0,
        "gpu_memory_utilization": 0.05,
        "disable_log_stats": False,
    }
    if "kv_cache_memory_bytes" in known:
        kwargs["kv_cache_memory_bytes"] = _KV_CACHE_BYTES
    if _extension_available():
        kwargs["worker_extension_cls"] = EXTENSION_CLS
    return kwargs


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("GENWORKER_MODEL_CACHE")
    base = Path(cache) if cache else tmp_path_factory.mktemp("models")
    return build_tiny_model(base / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Idefics3 (``build_tiny_vlm``); engines on it are the test modules' own."""
    cache = os.environ.get("GENWORKER_MODEL_CACHE")
    base = Path(cache) if cache else tmp_path_factory.mktemp("models")
    return build_tiny_vlm(base / "tiny-idefics3")


#: The test that started the session engine, while it runs (``pytest_runtest_setup``).
SESSION_ENGINE_STARTED_BY: list[str] = []
#: The test being set up.
_SETTING_UP: list[str] = []


@pytest.fixture(scope="session")
def cpu_engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    """The session's one engine, through the adapter."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.shell.vllm_engine import VllmEngine

    engine = VllmEngine.start(cpu_engine_kwargs(tiny_model_dir))
    SESSION_ENGINE_STARTED_BY.extend(_SETTING_UP[-1:])
    yield engine
    SESSION_ENGINE_STARTED_BY.clear()
    engine.shutdown()


@pytest.fixture(scope="session")
def cpu_llm(cpu_engine: VllmEngine) -> LLM:
    """The same engine as ``cpu_engine``, as the raw ``vllm.LLM``."""
    return cpu_engine.llm


#: The fixtures that hold the session's one in-process engine (``engine_fixtures``).
SESSION_ENGINE_FIXTURES = frozenset({"cpu_engine", "cpu_llm"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the session's engine run after every other test, in their collected order.

    An in-process vLLM engine tears down the process-wide distributed state when it shuts
    down (``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``, vllm/v1/engine/
    core.py, 0.32): a module that starts and stops an engine of its own while the session
    engine is alive leaves the session engine failing every step with "pipeline model
    parallel group is not initialized". Running the session engine's tests last keeps that
    from depending on the files' names. The GPU suite (marker ``gpu``) keeps the order it
    passed in: moved, three of its token-counter tests saw the counters stand still on the
    H100 (run of 30291d7; not diagnosed further)."""
    items.sort(
        key=lambda item: item.get_closest_marker("gpu") is None and uses_the_session_engine(item)
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that is not sorted with the session engine's must not run while it lives.

    It would be one that starts and stops an engine of its own (breaking the session
    engine for every test after it, far from the cause), run after a test that reached the
    session engine without saying so: a fixture that calls ``request.getfixturevalue``
    needs the ``session_engine`` marker on its test or parameter."""
    _SETTING_UP[:] = [item.nodeid]
    if item.get_closest_marker("gpu") is not None or uses_the_session_engine(item):
        return
    if SESSION_ENGINE_STARTED_BY:
        pytest.fail(
            f"{item.nodeid} runs while the session engine lives, started by "
            f"{SESSION_ENGINE_STARTED_BY[0]}, which is not marked session_engine: mark it "
            "(pytest.mark.session_engine) so that it runs after every other test",
            pytrace=False,
        )


def uses_the_session_engine(item: pytest.Item) -> bool:
    """Whether ``item`` needs the session engine: a fixture of its closure holds it, or it
    is marked ``session_engine`` (a test that asks for it by ``request.getfixturevalue``)."""
    closure = set(getattr(item, "fixturenames", ()))
    marked = item.get_closest_marker("session_engine") is not None
    return bool(SESSION_ENGINE_FIXTURES & closure) or marked

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


@pytest.fixture(scope="session")
def cpu_engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    """The session's one engine, through the adapter."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from genworker.shell.vllm_engine import VllmEngine

    engine = VllmEngine.start(cpu_engine_kwargs(tiny_model_dir))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def cpu_llm(cpu_engine: VllmEngine) -> LLM:
    """The same engine as ``cpu_engine``, as the raw ``vllm.LLM``."""
    return cpu_engine.llm

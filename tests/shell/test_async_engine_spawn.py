"""On CUDA the async engine asks vLLM for a spawned engine core.

vLLM forks its engine core unless torch reports CUDA initialized, and asks for spawn
through ``os.environ``, which its environment cache (on once an in-process engine has
started) hides: on the H200 (vLLM 0.25) the forked child died re-initializing CUDA, in a
process that had only counted its GPUs and in one with an in-process engine.
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import vllm.envs

from genworker.shell import async_engine

VAR = "VLLM_WORKER_MULTIPROC_METHOD"


@pytest.fixture
def cached_envs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """vLLM's environment behind a cache, as after an in-process engine start; the names
    read through it are recorded."""
    read: list[str] = []

    @functools.cache
    def cached(name: str) -> object:
        read.append(name)
        return vllm.envs.environment_variables[name]()

    monkeypatch.setattr(vllm.envs, "__getattr__", cached)
    return read


def on(monkeypatch: pytest.MonkeyPatch, device: str, method: str | None) -> None:
    monkeypatch.setattr(async_engine, "current_platform", types.SimpleNamespace(device_type=device))
    if method is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, method)


@pytest.mark.parametrize("method", [None, "fork"])
def test_on_cuda_the_engine_core_is_spawned_and_the_cache_sees_it(
    monkeypatch: pytest.MonkeyPatch, cached_envs: list[str], method: str | None
) -> None:
    on(monkeypatch, "cuda", method)
    assert vllm.envs.__getattr__(VAR) == (method or "fork")  # cached before the start
    async_engine._spawn_on_cuda()
    assert os.environ[VAR] == "spawn"
    assert vllm.envs.__getattr__(VAR) == "spawn"
    assert cached_envs == [VAR, VAR]  # read again after the cache was cleared


@pytest.mark.parametrize(
    ("device", "method"), [("cpu", "fork"), ("cpu", None), ("cuda", "spawn"), ("cpu", "spawn")]
)
def test_otherwise_the_environment_and_the_cache_are_left_alone(
    monkeypatch: pytest.MonkeyPatch, cached_envs: list[str], device: str, method: str | None
) -> None:
    on(monkeypatch, device, method)
    before = vllm.envs.__getattr__(VAR)
    async_engine._spawn_on_cuda()
    assert vllm.envs.__getattr__(VAR) == before
    assert cached_envs == [VAR]  # still cached
    assert os.environ.get(VAR) == method

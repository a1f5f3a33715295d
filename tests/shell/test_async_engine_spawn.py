"""The async engine asks vLLM for a spawned engine core when CUDA is up in this process.

vLLM forks its engine core unless it sees CUDA initialized, and asks for spawn through
``os.environ``, which its environment cache (on once an in-process engine has started)
hides: the H200 run of vLLM 0.25 forked and the child died re-initializing CUDA.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
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


@pytest.mark.parametrize("method", [None, "fork"])
def test_with_cuda_up_the_engine_core_is_spawned_and_the_cache_sees_it(
    monkeypatch: pytest.MonkeyPatch, cached_envs: list[str], method: str | None
) -> None:
    if method is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, method)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert vllm.envs.__getattr__(VAR) == (method or "fork")  # cached before the start
    async_engine._spawn_when_cuda_is_up()
    assert vllm.envs.__getattr__(VAR) == "spawn"
    assert cached_envs == [VAR, VAR]  # read again after the cache was cleared


@pytest.mark.parametrize(("cuda", "method"), [(False, "fork"), (False, None), (True, "spawn")])
def test_otherwise_the_environment_and_the_cache_are_left_alone(
    monkeypatch: pytest.MonkeyPatch, cached_envs: list[str], cuda: bool, method: str | None
) -> None:
    if method is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, method)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    before = vllm.envs.__getattr__(VAR)
    async_engine._spawn_when_cuda_is_up()
    assert vllm.envs.__getattr__(VAR) == before
    assert cached_envs == [VAR]  # still cached
    assert (VAR in os.environ) == (method is not None)

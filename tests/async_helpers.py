"""Shared pieces of the async worker's tests (importable as ``async_helpers``).

:func:`send_weights` is the ONE place these tests move weights from a "trainer" to an
engine: ``genworker.shell.refit.RefitSender.ipc`` to the worker's ``refit_address()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from helpers import base_config

from genworker.shell.errors import GenworkerError

_T = TypeVar("_T")


def async_config(**overrides: Any) -> dict[str, Any]:
    """``helpers.base_config`` with ``vllm_cfg.async_engine: true``."""
    vllm_cfg = {"async_engine": True, **overrides.pop("vllm_cfg", {})}
    return base_config(vllm_cfg=vllm_cfg, **overrides)


async def collect(
    stream: AsyncIterator[tuple[int, _T | GenworkerError]],
) -> list[tuple[int, _T | GenworkerError]]:
    """Every item of a stream, in arrival order."""
    return [item async for item in stream]


def outputs(items: list[tuple[int, Any]]) -> dict[int, dict[str, torch.Tensor]]:
    """The rows that succeeded, by row (each once)."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for row, item in items:
        assert row not in rows, f"row {row} came back twice"
        if not isinstance(item, GenworkerError):
            rows[row] = item
    return rows


def generated(out: Mapping[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """A one-row output's generated tokens and their weight versions."""
    g = int(out["generation_lengths"][0])
    start = int(out["unpadded_sequence_lengths"][0]) - g
    return (
        out["output_ids"][0, start : start + g].tolist(),
        out["weight_versions"][0, start : start + g].tolist(),
    )


async def until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``check`` on the loop until it holds (bounded)."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.002)


@contextmanager
def sending(address: str, tensors: Mapping[str, torch.Tensor]) -> Iterator[list[object]]:
    """Send one refit to ``address`` from a thread while the body awaits the engine side;
    the sender's report (or exception) lands in the yielded list."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(send_weights(address, tensors))
        except Exception as e:  # noqa: BLE001 - handed to the test through `outcome`
            outcome.append(e)

    thread = threading.Thread(target=run, name="test trainer", daemon=True)
    thread.start()
    try:
        yield outcome
    finally:
        thread.join(120)
        assert not thread.is_alive(), "the trainer thread did not finish"


def send_weights(address: str, tensors: Mapping[str, torch.Tensor]) -> object:
    """The trainer's side of one IPC refit (the one refit-transport call of these tests)."""
    from genworker.shell.refit import RefitSender

    with RefitSender.ipc(address, timeout_s=60.0) as sender:
        return sender.send(tensors.items())


def run_soon(loop: asyncio.AbstractEventLoop, coro: Awaitable[_T], timeout_s: float = 300.0) -> _T:
    """Run ``coro`` to completion on ``loop`` (this thread), bounded."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))


@contextmanager
def own_prometheus_metrics() -> Iterator[None]:
    """vLLM's stat logger unregisters every ``vllm:`` collector of the process registry
    when an engine starts (``PrometheusStatLogger.__init__``): give the session engine's
    collectors back when the block's engine is gone (the AsyncLLM modules)."""
    from prometheus_client import REGISTRY

    def ours() -> list[Any]:
        return [
            c
            for c in list(REGISTRY._collector_to_names)
            if str(getattr(c, "_name", "")).startswith("vllm:")
        ]

    before = ours()
    try:
        yield
    finally:
        for collector in ours():
            REGISTRY.unregister(collector)
        for collector in before:
            REGISTRY.register(collector)

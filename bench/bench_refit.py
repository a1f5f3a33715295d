"""Refit throughput on CPU: a 1 GiB state dict from a trainer process into a receiver.

The trainer is a spawned process holding 64 float32 tensors of 16 MiB; the receiver is
this process, writing into a preallocated dict of parameters of the same names (the
direct route of ``WorkerExtension``, no engine). One ``RefitSender`` each, defaults only:

- ``refit_gbps_ipc``: shared memory + ZMQ (``RefitSender.ipc``). The first refit packs
  (the sender has not seen these storages yet: ``refit_ipc_packed_vs_memcpy``, two
  copies, pack then store); later ones send the tensors' own storages, which the
  receiver keeps mapped (one copy);
- ``refit_gbps_collective``: a standalone gloo group on loopback (``RefitSender.collective``).

Each is compared with a raw operation of the same size measured in the same run:
``refit_ipc_vs_memcpy`` against one in-process 1 GiB ``copy_``, ``refit_collective_vs_raw``
against one 1 GiB broadcast over the same gloo group. Rates are payload bytes over the
trainer's wall time from the first message to the receiver's final answer; the best of
``REPEATS`` runs counts (the host is shared).
"""

from __future__ import annotations

import functools
import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import Protocol

import torch

from genworker.shell.refit import CollectiveReceiver, IpcReceiver, RefitSender, fake, manifest_of

__all__ = ["measure"]

TENSORS = 64
ELEMENTS = 4 << 20  # 16 MiB of float32 each: 1 GiB in all
REPEATS = 3
TIMEOUT_S = 120.0


class _Queue(Protocol):
    def put(self, item: object) -> None: ...

    def get(self, timeout: float | None = None) -> object: ...


def state_dict() -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)}


def _trainer(commands: _Queue, results: _Queue, address: str, port: int) -> None:
    torch.set_num_threads(1)
    tensors = state_dict()
    manifest = manifest_of(tensors)
    with RefitSender.ipc(address, manifest=manifest, timeout_s=TIMEOUT_S) as ipc:
        for _ in range(REPEATS):
            commands.get()
            results.put(ipc.send(tensors.items()).gbps)
    with RefitSender.collective(
        "127.0.0.1", port, 2, manifest=manifest, timeout_s=TIMEOUT_S
    ) as sender:
        for _ in range(REPEATS):
            results.put(sender.send(tensors.items()).gbps)
        raw = torch.zeros(TENSORS * ELEMENTS * 4, dtype=torch.uint8)
        group = sender.group
        assert group is not None
        for _ in range(REPEATS):
            started = time.monotonic()
            group.transfer([raw], "the raw broadcast", TIMEOUT_S)
            group.settle(None, "the raw broadcast", TIMEOUT_S)
            results.put(raw.numel() / (time.monotonic() - started) / 1e9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_MEMCPY: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _copy(nbytes: int) -> None:
    if nbytes not in _MEMCPY:
        src = torch.ones(nbytes // 4)
        _MEMCPY[nbytes] = (src, torch.empty_like(src))
    src, dst = _MEMCPY[nbytes]
    dst.copy_(src)


def _best_seconds(fn: Callable[[], None], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def measure() -> list[tuple[str, float]]:
    """Throughputs (GB/s) of both transports and their ratios to the raw operations."""
    expected = state_dict()
    params = {n: torch.zeros_like(t) for n, t in expected.items()}
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())

    memcpy_gbps = nbytes / _best_seconds(functools.partial(_copy, nbytes)) / 1e9

    receiver = IpcReceiver(torch.device("cpu"))
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(
        target=_trainer, args=(commands, results, receiver.address, port), daemon=True
    )
    trainer.start()
    try:
        ipc = []
        for _ in range(REPEATS):
            commands.put("go")
            fake.receive_into(receiver, params, timeout_s=TIMEOUT_S)
            _check(params, expected)
            for p in params.values():
                p.zero_()
            ipc.append(float(results.get(timeout=TIMEOUT_S)))
        receiver.close()

        group = fake.engine_group(port, timeout_s=TIMEOUT_S)
        collective = []
        transport = CollectiveReceiver(group)  # one per group: it keeps its buffers
        for _ in range(REPEATS):
            fake.receive_into(transport, params, timeout_s=TIMEOUT_S)
            collective.append(float(results.get(timeout=TIMEOUT_S)))
        _check(params, expected)
        params.clear()
        raw_buffer = torch.empty(nbytes, dtype=torch.uint8)
        raw = []
        for _ in range(REPEATS):
            group.transfer([raw_buffer], "the raw broadcast", TIMEOUT_S)
            group.settle(None, "the raw broadcast", TIMEOUT_S)
            raw.append(float(results.get(timeout=TIMEOUT_S)))
        group.close()
    finally:
        receiver.close()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    _MEMCPY.clear()
    ipc_gbps, collective_gbps, raw_gbps = max(ipc), max(collective), max(raw)
    return [
        ("refit_gbps_ipc", ipc_gbps),
        ("refit_gbps_collective", collective_gbps),
        ("refit_ipc_vs_memcpy", ipc_gbps / memcpy_gbps),
        ("refit_ipc_packed_vs_memcpy", ipc[0] / memcpy_gbps),
        ("refit_collective_vs_raw", collective_gbps / raw_gbps),
        ("refit_memcpy_gbps", memcpy_gbps),
        ("refit_raw_gloo_gbps", raw_gbps),
    ]


def _check(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        if not torch.equal(params[name], tensor):
            raise AssertionError(f"the refit delivered wrong data for {name}")


if __name__ == "__main__":
    started = time.perf_counter()
    for key, value in measure():
        print(f"{key}={value:.4g}", flush=True)
    print(f"# bench_refit took {time.perf_counter() - started:.1f} s")

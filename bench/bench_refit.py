"""Refit throughput on CPU: a 1 GiB state dict from a trainer process into a receiver.

The trainer is a spawned process holding 64 float32 tensors of 16 MiB; the receiver is
this process, writing into a preallocated dict of parameters of the same names (the
direct route of ``WorkerExtension``, no engine). One ``RefitSender`` each, defaults only:

- ``refit_gbps_ipc``: shared memory + ZMQ (``RefitSender.ipc``), the same tensors every
  refit: the first packs (the sender has not seen the storages), the second moves them
  into shared memory (once) and the receiver maps them, later ones are the steady state
  (one copy, from the trainer's memory into the parameters), the figure here; each of
  those is paired with one that runs the engine's non-finite check on every chunk
  (``EngineContext.check_finite``, what ``vllm_cfg.refit_finite_check`` switches):
  ``refit_finite_check_overhead`` is the best checked refit's receiver time over the best
  unchecked one's, same run (1.0: free); then
  ``refit_ipc_packed_vs_memcpy``: fresh tensors every refit, so always packed (two copies,
  pack then store, through the staging buffers kept from the refits before);
- ``refit_gbps_collective``: a standalone gloo group on loopback (``RefitSender.collective``).

Each refit is paired with a raw operation of the same size measured right before it in
the same run (the host is shared and noisy, so only pairs compare): ``refit_ipc_vs_memcpy``
with one in-process 1 GiB ``copy_``, ``refit_collective_vs_raw`` with one 1 GiB broadcast
over the same gloo group; the best pair counts. Rates are payload bytes over the
trainer's wall time from the first message to the receiver's final answer.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from typing import Protocol

import torch

from genworker.shell.refit import CollectiveReceiver, IpcReceiver, RefitSender, fake, manifest_of
from genworker.shell.refit.engine import EngineContext

__all__ = ["measure"]

TENSORS = 64
ELEMENTS = 4 << 20  # 16 MiB of float32 each: 1 GiB in all
WARMUPS = 2  # IPC: packed first, then moved to shared memory and mapped
REPEATS = 3  # steady IPC refits without the non-finite check, and as many with it
FRESH = 2
TIMEOUT_S = 120.0


class _Queue(Protocol):
    def put(self, item: object) -> None: ...

    def get(self, timeout: float | None = None) -> object: ...


def state_dict() -> dict[str, torch.Tensor]:
    return {f"layer.{i}.weight": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)}


def _rate(report: object) -> float:
    return float(report.nbytes / report.seconds / 1e9)  # type: ignore[attr-defined]


def _trainer(commands: _Queue, results: _Queue, address: str, port: int) -> None:
    torch.set_num_threads(1)
    tensors = state_dict()
    manifest = manifest_of(tensors)
    with RefitSender.ipc(address, manifest=manifest, timeout_s=TIMEOUT_S) as ipc:
        for i in range(WARMUPS + 2 * REPEATS + FRESH):
            same = i < WARMUPS + 2 * REPEATS
            sent = tensors if same else {n: t.clone() for n, t in tensors.items()}
            commands.get()
            results.put(_rate(ipc.send(sent.items())))
    with RefitSender.collective(
        "127.0.0.1", port, 2, manifest=manifest, timeout_s=TIMEOUT_S
    ) as sender:
        raw = torch.zeros(TENSORS * ELEMENTS * 4, dtype=torch.uint8)
        group = sender.group
        assert group is not None
        for _ in range(REPEATS):
            started = time.monotonic()
            group.transfer([raw], "the raw broadcast", TIMEOUT_S)
            group.settle(None, "the raw broadcast", TIMEOUT_S)
            results.put(raw.numel() / (time.monotonic() - started) / 1e9)
            results.put(_rate(sender.send(tensors.items())))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _memcpy_gbps(src: torch.Tensor, dst: torch.Tensor) -> float:
    """One-way GB/s of the best of two 1 GiB copies, now."""
    times = []
    for _ in range(2):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return src.numel() * src.element_size() / min(times) / 1e9


def measure() -> list[tuple[str, float]]:
    """Throughputs (GB/s) of both transports and their ratios to the raw operations."""
    expected = state_dict()
    params = {n: torch.zeros_like(t) for n, t in expected.items()}
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    receiver = IpcReceiver(torch.device("cpu"))
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(
        target=_trainer, args=(commands, results, receiver.address, port), daemon=True
    )
    trainer.start()
    ipc: list[tuple[float, float]] = []  # (refit GB/s, memcpy GB/s right before)
    seconds: dict[bool, list[float]] = {False: [], True: []}  # steady, by the check
    check = EngineContext(object()).check_finite
    try:
        for i in range(WARMUPS + 2 * REPEATS + FRESH):
            checked = WARMUPS <= i < WARMUPS + 2 * REPEATS and (i - WARMUPS) % 2 == 1
            memcpy = _memcpy_gbps(src, dst)
            commands.put("go")
            report = fake.receive_into(
                receiver, params, timeout_s=TIMEOUT_S, check=check if checked else None
            )
            rate = float(results.get(timeout=TIMEOUT_S))  # type: ignore[arg-type]
            if WARMUPS <= i < WARMUPS + 2 * REPEATS:
                seconds[checked].append(report.seconds)
            if not checked:
                ipc.append((rate, memcpy))
            _check(params, expected)
            for p in params.values():
                p.zero_()
        receiver.close()
        del src, dst
        group = fake.engine_group(port, timeout_s=TIMEOUT_S)
        transport = CollectiveReceiver(group)
        raw_buffer = torch.empty(nbytes, dtype=torch.uint8)
        collective: list[tuple[float, float]] = []  # (refit GB/s, raw GB/s right before)
        for _ in range(REPEATS):
            group.transfer([raw_buffer], "the raw broadcast", TIMEOUT_S)
            group.settle(None, "the raw broadcast", TIMEOUT_S)
            raw = float(results.get(timeout=TIMEOUT_S))  # type: ignore[arg-type]
            fake.receive_into(transport, params, timeout_s=TIMEOUT_S)
            collective.append((float(results.get(timeout=TIMEOUT_S)), raw))  # type: ignore[arg-type]
        _check(params, expected)
        group.close()
    finally:
        receiver.close()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    steady, packed = ipc[WARMUPS : WARMUPS + REPEATS], ipc[WARMUPS + REPEATS :]
    return [
        ("refit_gbps_ipc", max(r for r, _ in steady)),
        ("refit_gbps_collective", max(r for r, _ in collective)),
        ("refit_ipc_vs_memcpy", max(r / m for r, m in steady)),
        ("refit_ipc_packed_vs_memcpy", max(r / m for r, m in packed)),
        ("refit_collective_vs_raw", max(r / m for r, m in collective)),
        ("refit_memcpy_gbps", max(m for _, m in ipc)),
        ("refit_raw_gloo_gbps", max(m for _, m in collective)),
        ("refit_finite_check_overhead", min(seconds[True]) / min(seconds[False])),
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

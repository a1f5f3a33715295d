"""Refit host overhead on CPU: what a refit costs when its bytes cost nothing.

A spawned trainer holds 195 float32 tensors of 64 KiB (the 8B model's tensor count; small,
so the copies are ~12 MiB in all; any size travels by handle once recognised) and refits them
into this process by ``RefitSender.ipc`` and :func:`fake.receive_into` (direct writes),
the same tensors every refit: after two warm-ups every refit is the RL steady state (kept
handles, one chunk). ``refit_host_overhead_ms``: the best steady refit's trainer wall
time; ``refit_host_per_tensor_us`` the same per tensor; the phases (best refit's) of both
sides follow as ``refit_host_<side>_<phase>_ms``; ``refit_host_memcpy_ms``: one
in-process copy of the same bytes, for scale.
"""

from __future__ import annotations

import multiprocessing
import time

import torch

from genworker.shell.refit import IpcReceiver, RefitSender, fake, manifest_of
from genworker.shell.refit.memory import copy_into

__all__ = ["measure"]

TENSORS = 195
ELEMENTS = 16 << 10  # 64 KiB of float32
WARMUPS = 2
REPEATS = 20
TIMEOUT_S = 60.0


def state_dict() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)}


def _trainer(commands: object, results: object, address: str) -> None:
    torch.set_num_threads(1)
    tensors = state_dict()
    with RefitSender.ipc(address, manifest=manifest_of(tensors), timeout_s=TIMEOUT_S) as ipc:
        for _ in range(WARMUPS + REPEATS):
            commands.get()  # type: ignore[attr-defined]
            report = ipc.send(tensors.items())
            results.put((report.seconds, dict(report.phases)))  # type: ignore[attr-defined]


def measure() -> list[tuple[str, float]]:
    expected = state_dict()
    params = {n: torch.zeros_like(t) for n, t in expected.items()}
    src = torch.cat(list(expected.values()))
    dst = torch.empty_like(src)
    receiver = IpcReceiver(torch.device("cpu"))
    ctx = multiprocessing.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(commands, results, receiver.address), daemon=True)
    trainer.start()
    runs = []
    try:
        for _ in range(WARMUPS + REPEATS):
            commands.put("go")
            engine = fake.receive_into(receiver, params, timeout_s=TIMEOUT_S)
            seconds, phases = results.get(timeout=TIMEOUT_S)
            runs.append((seconds, phases, dict(engine.phases)))
        for name, tensor in expected.items():
            if not torch.equal(params[name], tensor):
                raise AssertionError(f"the refit delivered wrong data for {name}")
    finally:
        receiver.close()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()
    copies = []
    for _ in range(5):
        started = time.perf_counter()
        copy_into(dst, src)
        copies.append(time.perf_counter() - started)
    best = min(runs[WARMUPS:], key=lambda r: r[0])
    figures = [
        ("refit_host_overhead_ms", best[0] * 1e3),
        ("refit_host_per_tensor_us", best[0] * 1e6 / TENSORS),
        ("refit_host_memcpy_ms", min(copies) * 1e3),
    ]
    for side, phases in (("trainer", best[1]), ("engine", best[2])):
        figures += [(f"refit_host_{side}_{k}_ms", v * 1e3) for k, v in sorted(phases.items())]
    return figures


if __name__ == "__main__":
    for key, value in measure():
        print(f"{key}={value:.4g}", flush=True)
